//! The weights upload path (pinned staging ring -> device) on the test driver (host memory stands in for the
//! GPU): every tensor lands at its planned offset, byte for byte.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::sync::Arc;

use tf_cuda::{Context, Driver, Stream};
use tf_engines::nn::weights::ModelDir;
use tf_engines::qwen_image::config::QwenImageDitConfig;
use tf_testdriver::{library_path, test_lock};

#[test]
fn upload_through_a_staging_ring_places_every_tensor() {
    let _serial = test_lock();
    let driver = Arc::new(
        Driver::open_path(&library_path().expect("find the test driver")).expect("open it"),
    );
    let ctx = Context::new(driver, 0).expect("context on device 0");
    let stream = Stream::new(&ctx, true).expect("stream");

    let model = ModelDir::open(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_dit/cond_b2/model"),
    )
    .unwrap();
    let config = QwenImageDitConfig::from_json(model.config_json()).unwrap();
    let specs = config.tensor_specs();
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    let plan = model.upload_plan(&names, 256).unwrap();
    // Staging smaller than most tensors, so tensors split over chunks and the ring wraps many times.
    let (device, stats) = plan.upload(&model, &ctx, &stream, 4096, 3).unwrap();
    println!("uploaded {stats}");
    assert_eq!(stats.bytes, model.total_bytes());
    assert_eq!(device.len(), plan.device_bytes);
    let mut back = vec![0u8; plan.device_bytes];
    device.download(0, &mut back).unwrap();
    for item in &plan.items {
        assert_eq!(
            &back[item.device_offset..item.device_offset + item.len],
            model.bytes(&item.name).unwrap(),
            "{}",
            item.name
        );
    }
}
