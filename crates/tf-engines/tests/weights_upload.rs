//! The one weight upload ring (pinned staging slots -> device) on the test driver (host memory stands in for the
//! GPU): every tensor lands at its planned offset, byte for byte or converted to bf16, and a ring that fails part
//! way waits for its copies and frees its pinned slots.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use tf_cuda::{DeviceBuffer, Stream};
use tf_engines::nn::upload::{
    convert_to_bf16, fill_host, upload_pieces, ChunkTransform, Piece, StagingConfig, Transform,
    UploadError,
};
use tf_engines::nn::weights::{LayoutPlanner, ModelDir};
use tf_engines::qwen_image::config::QwenImageDitConfig;
use tf_testdriver::test_lock;

#[path = "common/test_driver.rs"]
mod test_driver;

fn fixture() -> ModelDir {
    ModelDir::open(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_dit/cond_b2/model"),
    )
    .unwrap()
}

fn names(model: &ModelDir) -> Vec<String> {
    let config = QwenImageDitConfig::from_json(model.config_json()).unwrap();
    config.tensor_specs().into_iter().map(|s| s.name).collect()
}

/// Every tensor at an aligned offset of its own, as the engines lay weights out.
fn layout(
    model: &ModelDir,
    names: &[String],
    device_bytes: impl Fn(usize) -> usize,
) -> (Vec<usize>, usize) {
    let mut planner = LayoutPlanner::new(256);
    let offsets = names
        .iter()
        .map(|n| {
            let info = model.info(n).unwrap();
            planner.one(device_bytes(info.elements())).unwrap()
        })
        .collect();
    (offsets, planner.total().unwrap())
}

fn small_ring() -> StagingConfig {
    // Slots smaller than most tensors, so tensors split over chunks and the ring wraps many times.
    StagingConfig {
        slot_bytes: 4096,
        slots: 3,
        threads: 2,
    }
}

#[test]
fn the_ring_places_every_tensor_as_stored_and_as_bf16() {
    let _serial = test_lock();
    let ctx = test_driver::context();
    let stream = Stream::new(&ctx, true).expect("stream");
    let model = fixture();
    let names = names(&model);

    // Raw bytes, as stored.
    let sizes: Vec<usize> = names
        .iter()
        .map(|n| model.info(n).unwrap().len_bytes())
        .collect();
    let mut planner = LayoutPlanner::new(256);
    let offsets: Vec<usize> = sizes.iter().map(|&b| planner.one(b).unwrap()).collect();
    let total = planner.total().unwrap();
    let pieces: Vec<Piece<'_>> = names
        .iter()
        .zip(&offsets)
        .map(|(n, &o)| Piece::copy(model.bytes(n).unwrap(), o))
        .collect();
    let mut device = DeviceBuffer::alloc(&ctx, total).unwrap();
    let stats = upload_pieces(&ctx, &stream, &mut device, &pieces, small_ring()).unwrap();
    println!("uploaded {stats}");
    assert_eq!(stats.source_bytes, model.total_bytes());
    assert_eq!(stats.device_bytes, model.total_bytes());
    let mut back = vec![0u8; total];
    device.download(0, &mut back).unwrap();
    for ((name, &offset), &len) in names.iter().zip(&offsets).zip(&sizes) {
        assert_eq!(
            &back[offset..offset + len],
            model.bytes(name).unwrap(),
            "{name}"
        );
    }

    // Converted to bf16 on the way (the fixture stores f32).
    let (offsets, total) = layout(&model, &names, |n| n * 2);
    let pieces: Vec<Piece<'_>> = names
        .iter()
        .zip(&offsets)
        .map(|(n, &o)| Piece::bf16(model.bytes(n).unwrap(), model.info(n).unwrap().dtype, o))
        .collect();
    let mut device = DeviceBuffer::alloc(&ctx, total).unwrap();
    device.fill_u8(0, None).unwrap();
    let stats = upload_pieces(&ctx, &stream, &mut device, &pieces, small_ring()).unwrap();
    assert_eq!(stats.device_bytes * 2, model.total_bytes());
    let mut back = vec![0u8; total];
    device.download(0, &mut back).unwrap();
    // The host image of the same pieces is the device image.
    let mut host = vec![0u8; total];
    fill_host(&mut host, &pieces, 4096, 2).unwrap();
    assert!(back == host);
    for (name, &offset) in names.iter().zip(&offsets) {
        let info = model.info(name).unwrap();
        let mut want = vec![0u8; info.elements() * 2];
        convert_to_bf16(model.bytes(name).unwrap(), info.dtype, &mut want).unwrap();
        assert_eq!(&back[offset..offset + want.len()], &want[..], "{name}");
    }
}

/// Fails on the chunk that starts at element `at`, after earlier chunks were copied.
struct FailAt {
    at: usize,
}

impl ChunkTransform for FailAt {
    fn name(&self) -> &'static str {
        "fail-at"
    }
    fn src_elem_bytes(&self) -> usize {
        1
    }
    fn dst_elem_bytes(&self) -> usize {
        1
    }
    fn apply(&self, first: usize, src: &[u8], dst: &mut [u8]) -> Result<(), UploadError> {
        if first >= self.at {
            return Err(UploadError::Transform {
                transform: "fail-at",
                why: format!("chunk at element {first}"),
            });
        }
        dst.copy_from_slice(src);
        Ok(())
    }
}

#[test]
fn a_ring_that_fails_part_way_waits_and_frees_its_slots() {
    let _serial = test_lock();
    let ctx = test_driver::context();
    let stream = Stream::new(&ctx, true).expect("stream");
    let before = tf_cuda::usage();
    let src: Vec<u8> = (0..64 * 1024u32).map(|i| (i % 253) as u8).collect();
    let fail = FailAt { at: 5 * 4096 };
    let pieces = [Piece {
        src: &src,
        transform: Transform::Custom(&fail),
        dst_offset: 0,
    }];
    let mut device = DeviceBuffer::alloc(&ctx, src.len()).unwrap();
    let err = upload_pieces(&ctx, &stream, &mut device, &pieces, small_ring()).unwrap_err();
    assert!(err.to_string().contains("fail-at"), "{err}");
    // The chunks before the failure landed: the ring waited for them before freeing the slots.
    let mut back = vec![0u8; 5 * 4096];
    device.download(0, &mut back).unwrap();
    assert_eq!(&back[..], &src[..5 * 4096]);
    let after = tf_cuda::usage();
    assert_eq!(after.host, before.host, "pinned staging must be freed");
    assert_eq!(after.host_allocs, before.host_allocs);

    // Refused before anything is allocated: a piece past the end.
    let err = upload_pieces(
        &ctx,
        &stream,
        &mut device,
        &[Piece::copy(&src, 1)],
        small_ring(),
    )
    .unwrap_err();
    assert!(matches!(err, UploadError::OutOfRange { .. }), "{err}");
    assert_eq!(tf_cuda::usage().host_allocs, before.host_allocs);
}
