fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (proto_dir, out) = (&args[1], &args[2]);
    let files: Vec<String> = ["common.proto", "sglang_scheduler.proto", "vllm_engine.proto"].iter().map(|f| format!("{proto_dir}/{f}")).collect();
    tonic_prost_build::configure()
        .build_server(true)
        .generate_default_stubs(true)
        .build_client(true)
        .build_transport(false)
        .out_dir(out)
        .compile_protos(&files, &[proto_dir.clone()])
        .unwrap();
}
