//! What the hostile-input tests share: a fixed source of randomness, and frames mutated the way
//! a fuzzer would (`fuzz_corpus.rs`, `hostile_peer.rs`).

/// xorshift64*: the same sequence on every run.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `frame` (at least 2 bytes) with a few bytes changed after its first: random values, or a
/// 4-byte window set to a length or an offset a decoder must not trust (rkyv's relative
/// pointers and lengths are 4 bytes).
pub fn mutate(frame: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut f = frame.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = 1 + rng.below(f.len() - 1);
        if rng.below(2) == 0 || at + 4 > f.len() {
            f[at] = rng.next() as u8;
        } else {
            let v: u32 = [u32::MAX, 0x7fff_ffff, 0x8000_0000, f.len() as u32, rng.next() as u32][rng.below(5)];
            f[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
    }
    f
}
