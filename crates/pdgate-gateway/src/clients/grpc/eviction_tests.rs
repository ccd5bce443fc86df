//! A connection made while its worker was being removed is not cached (`GrpcClient::forget`).
//! That a removed worker's connection is dropped is tested with membership (fleet/membership.rs).

use super::GrpcClient;

const URL: &str = "grpc://127.0.0.1:1";

#[tokio::test]
async fn a_connection_made_across_a_removal_is_not_cached() {
    let client = GrpcClient::new();
    // What `wire()` does around its detect: read the count, connect, insert if unchanged.
    let before = client.forgets.load(std::sync::atomic::Ordering::Acquire);
    client.forget(URL);
    let after = client.forgets.load(std::sync::atomic::Ordering::Acquire);
    assert_ne!(before, after, "a forget must be visible to a connect that raced it");
    // A connect to a listener that refuses: an error, and nothing cached.
    assert!(client.wire(URL, pdgate_core::Leg::Regular).await.is_err());
    assert!(!client.has_connection(URL));
}
