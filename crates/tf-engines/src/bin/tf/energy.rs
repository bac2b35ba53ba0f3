//! The board's energy over one `tf image` / `tf video` request (NVML's counter, `tf_cuda::power`): printed, and put
//! in the JSON summary as `board_energy_j`. Nothing without a device context or without NVML.

use tf_cuda::power::{EnergyMark, PowerMeter};

/// The board's energy counter now (`None` on the host backend or where NVML cannot be used).
pub fn mark(ctx: Option<&tf_cuda::Context>) -> Option<EnergyMark> {
    PowerMeter::for_context(ctx?).ok()?.mark().ok()
}

/// Joules the board spent since `mark`, printed on stderr after `tool`'s name.
pub fn spent(tool: &str, mark: Option<EnergyMark>) -> Option<f64> {
    let (joules, seconds) = mark?.spent().ok()?;
    let watts = if seconds > 0.0 { joules / seconds } else { 0.0 };
    eprintln!("{tool}: the board spent {joules:.1} J in the request ({watts:.0} W mean)");
    Some(joules)
}
