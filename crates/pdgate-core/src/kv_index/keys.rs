//! Content keys: a block's key is a hash of its parent's key and its token ids, under the
//! index's seed. Equal prefixes get equal keys on every worker and in every lookup.
//!
//! Only the final mix is chained from block to block; the token hashes of a prompt's blocks are
//! independent, so the CPU computes them side by side (a long prompt's keys cost about one
//! multiply per two tokens, not a dependent chain through every token). A 4-tokens-per-multiply
//! variant (64x64->128-bit folded multiplies) was measured against this one and showed no gain
//! above the noise of the loaded bench machine (docs/performance.md); not kept.

pub(super) const K1: u64 = 0x9e37_79b9_7f4a_7c15;
const K2: u64 = 0xff51_afd7_ed55_8ccd;

/// A strong 64-bit finalizer (murmur3's), a bijection.
pub(super) fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(K2);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// The parent key of a prompt's first block.
pub(super) fn root(seed: u64) -> u64 {
    mix(seed ^ K1)
}

/// The key of a block: its parent's key and a hash of its size and tokens, mixed under the seed.
pub(super) fn content_key(seed: u64, parent: u64, block_size: u32, tokens: &[u32]) -> u64 {
    mix(parent.rotate_left(17) ^ block_hash(seed, block_size, tokens))
}

/// Four independent lanes, each taking two tokens a step.
fn block_hash(seed: u64, block_size: u32, tokens: &[u32]) -> u64 {
    let base = mix(seed ^ (u64::from(block_size) << 32) ^ tokens.len() as u64);
    let mut lanes = [base ^ K1, base ^ K2, base.rotate_left(21) ^ K1, base.rotate_left(43) ^ K2];
    let step = |lane: u64, x: u64| (lane ^ x).wrapping_mul(K1).rotate_left(31);
    let mut eights = tokens.chunks_exact(8);
    for c in &mut eights {
        for (j, lane) in lanes.iter_mut().enumerate() {
            *lane = step(*lane, u64::from(c[2 * j]) | (u64::from(c[2 * j + 1]) << 32));
        }
    }
    for (j, &t) in eights.remainder().iter().enumerate() {
        lanes[j % 4] = step(lanes[j % 4], u64::from(t) | (1 << 63)); // the length is in `base`
    }
    mix(lanes[0] ^ lanes[1].rotate_left(16) ^ lanes[2].rotate_left(32) ^ lanes[3].rotate_left(48))
}
