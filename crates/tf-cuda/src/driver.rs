//! Opening the driver and what it says about itself (for `tf doctor` and start-up logs).

use std::path::PathBuf;
use std::sync::Arc;

use tf_sys::{Driver, Requirement};

use crate::context::DeviceInfo;
use crate::error::Error;

/// Opens the CUDA driver library (`TF_CUDA_DRIVER`, else `libcuda.so.1`, else `libcuda.so`) and
/// initializes it. The error lists every path tried.
pub fn open_driver() -> Result<Arc<Driver>, Error> {
    Driver::open()
        .map(Arc::new)
        .map_err(|e| Error::Driver(tf_sys::Error::DriverUnavailable(e)))
}

/// Opens the driver library at `path`.
pub fn open_driver_at(path: &std::path::Path) -> Result<Arc<Driver>, Error> {
    Driver::open_path(path)
        .map(Arc::new)
        .map_err(|e| Error::Driver(tf_sys::Error::DriverUnavailable(e)))
}

/// What the driver reports about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverInfo {
    /// The library that was opened.
    pub path: PathBuf,
    /// `1000 * major + 10 * minor` (13.0 -> 13000).
    pub version: i32,
    pub device_count: i32,
    /// Each optional entry of the table and whether this driver exports it.
    pub optional_entries: Vec<(&'static str, bool)>,
}

impl DriverInfo {
    /// `major.minor` of the driver's CUDA version.
    pub fn version_text(&self) -> String {
        format!("{}.{}", self.version / 1000, (self.version % 1000) / 10)
    }
}

/// Queries the driver's version, device count and optional entries.
pub fn driver_info(driver: &Driver) -> Result<DriverInfo, Error> {
    let optional_entries = tf_sys::ENTRIES
        .iter()
        .filter(|e| e.requirement == Requirement::Optional)
        .map(|e| {
            let name = format!("{}\0", e.name);
            // SAFETY: only the symbol's presence is read; nothing is called through it.
            let present = unsafe {
                driver
                    .library()
                    .get::<*const std::ffi::c_void>(name.as_bytes())
            }
            .is_ok();
            (e.name, present)
        })
        .collect();
    Ok(DriverInfo {
        path: driver.path().to_path_buf(),
        version: driver.version()?,
        device_count: driver.device_count()?,
        optional_entries,
    })
}

/// Device facts for every device the driver sees (no contexts are made).
pub fn devices(driver: &Driver) -> Result<Vec<Result<DeviceInfo, Error>>, Error> {
    let count = driver.device_count()?;
    Ok((0..count)
        .map(|ordinal| DeviceInfo::query(driver, ordinal))
        .collect())
}
