//! A small seeded generator (splitmix64) for reproducible test inputs, random weights and benchmarks.
//!
//! Not the sampling noise: that is [`super::noise`], whose algorithm is normative. This one only has to be
//! the same on every machine, so that a test or a benchmark draws the same values everywhere.
//!
//! ```
//! use tf_engines::nn::sampling::seeded::SplitMix64;
//! let mut rng = SplitMix64::new(7);
//! let x = rng.uniform(-1.0, 1.0);
//! assert!((-1.0..1.0).contains(&x));
//! ```

use super::noise::splitmix64;

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64 over a counter that starts at the seed.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator whose first output is `splitmix64(seed + golden gamma)`.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA);
        splitmix64(self.0)
    }

    /// Uniform in `[lo, hi)` from the top 24 bits (exact in f32).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * unit
    }

    /// Uniform in `0..n` (`n > 0`; 0 when `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        (self.next_u64() % n as u64) as usize
    }

    /// `n` values uniform in `[lo, hi)`.
    pub fn uniform_vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_splitmix64_sequence() {
        // splitmix64 with seed 0: the first outputs of the reference implementation (Vigna).
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn uniform_stays_in_range_and_below_is_bounded() {
        let mut rng = SplitMix64::new(42);
        for _ in 0..1000 {
            let x = rng.uniform(-2.0, 3.0);
            assert!((-2.0..3.0).contains(&x));
            assert!(rng.below(7) < 7);
        }
        assert_eq!(rng.below(0), 0);
    }
}
