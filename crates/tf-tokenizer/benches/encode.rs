//! Tokens per second on a 1 MiB mixed corpus: the plain `tokenizers` call, tf-tokenizer with
//! a cold memo, and tf-tokenizer with a warm memo, in the same run.
//!
//! `cargo bench -p tf-tokenizer --bench encode`
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tf_tokenizer::Tokenizer;

const CORPUS_BYTES: usize = 1 << 20;

/// Documents of the golden corpus (ASCII, CJK, emoji, code, whitespace, spelled special
/// tokens), one in eight wrapped in a chat template, until 1 MiB.
fn corpus() -> Vec<String> {
    let texts: Vec<String> = common::golden()
        .iter()
        .filter(|l| l["kind"] == "text")
        .filter_map(|l| l["text"].as_str().map(str::to_string))
        .filter(|t| !t.is_empty())
        .collect();
    let mut docs = Vec::new();
    let mut total = 0;
    let mut i = 0usize;
    while total < CORPUS_BYTES {
        let text = &texts[i % texts.len()];
        let doc = if i.is_multiple_of(8) {
            format!("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
        } else {
            text.clone()
        };
        total += doc.len();
        docs.push(doc);
        i += 1;
    }
    docs
}

fn tokenizers_direct(tok: &Tokenizer, docs: &[String]) -> usize {
    docs.iter()
        .map(|d| {
            tok.inner()
                .encode_fast(d.as_str(), false)
                .map(|e| e.len())
                .unwrap_or(0)
        })
        .sum()
}

fn tf_encode(tok: &Tokenizer, docs: &[String]) -> usize {
    docs.iter()
        .map(|d| tok.encode(d).map(|ids| ids.len()).unwrap_or(0))
        .sum()
}

fn median_seconds(mut f: impl FnMut(), runs: usize) -> f64 {
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[runs / 2].as_secs_f64()
}

fn bench(c: &mut Criterion) {
    let docs = corpus();
    let bytes: usize = docs.iter().map(String::len).sum();
    let tok = Tokenizer::from_bytes(common::qwen_json(), "qwen fixture").expect("fixture loads");
    let tokens = tokenizers_direct(&tok, &docs);
    assert_eq!(
        tf_encode(&tok, &docs),
        tokens,
        "tf-tokenizer and tokenizers disagree on the corpus"
    );

    let mut group = c.benchmark_group("encode_1MiB_mixed");
    group.throughput(Throughput::Elements(tokens as u64));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(8));
    group.bench_function("tokenizers_encode_fast", |b| {
        b.iter(|| black_box(tokenizers_direct(&tok, &docs)))
    });
    group.bench_function("tf_cold_memo", |b| {
        b.iter(|| {
            tok.clear_memo();
            black_box(tf_encode(&tok, &docs))
        })
    });
    tf_encode(&tok, &docs);
    group.bench_function("tf_warm_memo", |b| {
        b.iter(|| black_box(tf_encode(&tok, &docs)))
    });
    group.finish();

    // One summary with all three figures and the ratios, measured the same way.
    let runs = 7;
    let direct = median_seconds(
        || {
            black_box(tokenizers_direct(&tok, &docs));
        },
        runs,
    );
    let cold = median_seconds(
        || {
            tok.clear_memo();
            black_box(tf_encode(&tok, &docs));
        },
        runs,
    );
    tf_encode(&tok, &docs);
    let warm = median_seconds(
        || {
            black_box(tf_encode(&tok, &docs));
        },
        runs,
    );
    let rate = |s: f64| tokens as f64 / s;
    let stats = tok.memo_stats();
    println!(
        "corpus: {} documents, {bytes} bytes, {tokens} tokens",
        docs.len()
    );
    println!(
        "tokenizers encode_fast : {:>12.0} tokens/s ({:.1} ms)",
        rate(direct),
        direct * 1e3
    );
    println!(
        "tf-tokenizer cold memo : {:>12.0} tokens/s ({:.1} ms)",
        rate(cold),
        cold * 1e3
    );
    println!(
        "tf-tokenizer warm memo : {:>12.0} tokens/s ({:.1} ms)",
        rate(warm),
        warm * 1e3
    );
    println!("ratio cold / tokenizers: {:.3}", direct / cold);
    println!("ratio warm / tokenizers: {:.3}", direct / warm);
    println!("ratio warm / cold      : {:.3}", cold / warm);
    println!(
        "memo: {} entries, {} hits, {} misses",
        stats.entries, stats.hits, stats.misses
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
