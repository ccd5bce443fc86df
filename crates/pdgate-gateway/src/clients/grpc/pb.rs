//! The SMG gRPC contract's messages and clients, generated from the `smg-grpc-proto` package's
//! protos (see scripts/gen_grpc_protos/README.md): SGLang's `SglangScheduler` and vLLM's
//! `VllmEngine`, and their shared `smg.grpc.common` types.
#![allow(clippy::all, clippy::pedantic, clippy::unwrap_used, clippy::expect_used, missing_docs, dead_code)]

pub mod smg {
    pub mod grpc {
        pub mod common {
            include!("gen/smg.grpc.common.rs");
        }
    }
}

pub mod sglang {
    pub mod grpc {
        pub mod scheduler {
            include!("gen/sglang.grpc.scheduler.rs");
        }
    }
}

pub mod vllm {
    pub mod grpc {
        pub mod engine {
            include!("gen/vllm.grpc.engine.rs");
        }
    }
}

pub use sglang::grpc::scheduler as sglang_pb;
pub use vllm::grpc::engine as vllm_pb;
