//! Routing decision benchmarks (placeholder while being written).
fn main() {}
