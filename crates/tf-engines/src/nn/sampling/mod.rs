//! Sampling: the [`scheduler::Scheduler`] trait a pipeline drives, the flow-match Euler sampler that implements
//! it, the portable seeded noise, and the seeded generator tests and benchmarks share.
pub mod flow_match;
pub mod noise;
pub mod scheduler;
pub mod seeded;
