//! The board's energy over one `tf image` / `tf video` request (NVML's counter, `tf_cuda::power`): printed, and put
//! in the JSON summary as `board_energy_j`. Nothing without a device context or without NVML.

use tf_cuda::power::{EnergyMark, OpeningLibrary, PowerLibrary};
use tf_engines::nn::backend::Backend;

/// Starts opening NVML on a thread of its own, beside the model's load (only for the GPU backend).
pub fn open(backend: Backend) -> Option<OpeningLibrary> {
    matches!(backend, Backend::Gpu).then(PowerLibrary::open_in_background)
}

/// The board's energy counter now (`None` on the host backend or where NVML cannot be used).
pub fn mark(opening: Option<OpeningLibrary>, ctx: Option<&tf_cuda::Context>) -> Option<EnergyMark> {
    let ctx = ctx?;
    opening?.wait().ok()?.meter_for(ctx).ok()?.mark().ok()
}

/// Joules the board spent since `mark`, printed on stderr after `tool`'s name.
pub fn spent(tool: &str, mark: Option<EnergyMark>) -> Option<f64> {
    let (joules, seconds) = mark?.spent().ok()?;
    let watts = if seconds > 0.0 { joules / seconds } else { 0.0 };
    eprintln!("{tool}: the board spent {joules:.1} J in the request ({watts:.0} W mean)");
    Some(joules)
}
