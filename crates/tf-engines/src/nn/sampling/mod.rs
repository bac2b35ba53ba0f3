//! Sampling: the flow-match Euler sampler and the portable seeded noise.
pub mod flow_match;
pub mod noise;
