//! `tf tokenize`: encode TEXT with a tokenizer.json and print the ids as a JSON array.
//!
//! Without `--masked`, added tokens spelled in TEXT are matched, as `tokenizers`' encode with
//! `add_special_tokens = false` does. With `--masked`, TEXT is a user span of an engine
//! request: it never forms an added token, special or not.
use std::path::PathBuf;
use std::process::ExitCode;

use tf_tokenizer::{Span, Tokenizer};

#[derive(clap::Args)]
pub struct Args {
    /// tokenizer.json, or a folder that holds one.
    #[arg(long, value_name = "FILE")]
    tokenizer: PathBuf,
    /// Treat TEXT as user text: no added token (`<|im_end|>`, `<think>`...) forms from it.
    #[arg(long)]
    masked: bool,
    /// The text to encode.
    text: String,
}

pub fn run(args: Args) -> ExitCode {
    let tokenizer = match Tokenizer::from_file(&args.tokenizer) {
        Ok(t) => t.with_memo_capacity(0),
        Err(e) => {
            eprintln!("tf tokenize: {e}");
            return ExitCode::FAILURE;
        }
    };
    let ids = if args.masked {
        tokenizer.encode_masked(&[Span::user(&args.text)])
    } else {
        tokenizer.encode(&args.text)
    };
    match ids {
        Ok(ids) => match serde_json::to_string(&ids) {
            Ok(json) => {
                println!("{json}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("tf tokenize: cannot print the ids: {e}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!("tf tokenize: {e}");
            ExitCode::FAILURE
        }
    }
}
