//! The board's energy over one `tf image` / `tf video` request (NVML's counter, `tf_cuda::power`): printed, and put
//! in the JSON summary as `board_energy_j`. Nothing without a device context or without NVML.

use tf_cuda::power::{EnergyMark, OpeningLibrary};

/// The board's energy counter now, from NVML opened beside the load (`Backend::open_power_library`); `None` on the
/// host backend or where NVML cannot be used.
pub fn mark(opening: Option<OpeningLibrary>, ctx: Option<&tf_cuda::Context>) -> Option<EnergyMark> {
    let ctx = ctx?;
    opening?.wait().ok()?.meter_for(ctx).ok()?.mark().ok()
}

/// Joules the board spent since `mark`, printed on stderr after `tool`'s name.
pub fn spent(tool: &str, mark: Option<EnergyMark>) -> Option<f64> {
    let spent = mark?.spent().ok()?;
    eprintln!(
        "{tool}: the board spent {:.1} J in the request ({:.0} W mean)",
        spent.joules,
        spent.mean_watts()
    );
    Some(spent.joules)
}
