//! Parsing of the worker's input lines into commands, with an error message for every malformed field.
//!
//! Two shapes of `generate` are accepted (docs/WORKER.md): LocalRouter's, where the image request is nested as
//! `{"request":{"image":{...}}}` and `dir` names the job folder, and a flat one, where the image fields sit at
//! the top level next to `out_dir` or `output`. Unknown fields are ignored, so newer senders keep working.

use std::path::PathBuf;

use serde_json::{Map, Value};

use super::{ImageJob, VideoJob, WorkerLimits};
use crate::nn::config::kind_of;

/// One parsed input line.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// Load the engine (idempotent).
    Load,
    /// Make `count` images for `job` and write them to `target`.
    Generate(GenerateCommand),
    /// Make one video (`request.video`) and write it into a folder.
    GenerateVideo(VideoCommand),
    /// Unload and end the process.
    Exit,
}

/// A validated `generate` command.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateCommand {
    /// The sender's job id (empty when absent), echoed in logs.
    pub id: String,
    /// Where the images go.
    pub target: OutputTarget,
    /// What to make.
    pub job: ImageJob,
    /// How many images; image `i` uses seed `job.seed + i`.
    pub count: u32,
}

/// A validated `generate` of `request.video`.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoCommand {
    /// The sender's job id (empty when absent), echoed in logs.
    pub id: String,
    /// The job folder (`dir` or `out_dir`): frames and audio are written there.
    pub dir: PathBuf,
    pub job: VideoJob,
}

/// Longest video accepted, in seconds.
pub const MAX_VIDEO_SECONDS: f32 = 60.0;
/// Highest frame rate accepted.
pub const MAX_FPS: u32 = 120;

/// Where a `generate` writes its images.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputTarget {
    /// A folder: images are written there as `image_<i>.png`; replies list those names.
    Folder(PathBuf),
    /// One file path (only with one image); the reply lists the path as given.
    File(PathBuf),
}

/// Why a line is not a valid command: the text goes back to the sender as an `invalid_request_error`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RequestError(pub String);

fn bad(message: impl Into<String>) -> RequestError {
    RequestError(message.into())
}

/// Parses one input line (without its newline).
pub fn parse_command(line: &str, limits: &WorkerLimits) -> Result<Command, RequestError> {
    let value: Value = serde_json::from_str(line).map_err(|e| {
        bad(format!(
            "the line is not valid JSON ({e}); send one JSON object per line"
        ))
    })?;
    let Value::Object(fields) = value else {
        return Err(bad(format!(
            "expected a JSON object such as {{\"op\":\"load\"}}, got {}",
            kind_of(&value)
        )));
    };
    let op = match fields.get("op") {
        Some(Value::String(op)) => op.as_str(),
        Some(other) => {
            return Err(bad(format!(
                "field `op` must be a string (load, generate or exit), got {}",
                kind_of(other)
            )))
        }
        None => {
            return Err(bad(
                "field `op` is missing; it must be one of load, generate, exit",
            ))
        }
    };
    match op {
        "load" => Ok(Command::Load),
        "exit" => Ok(Command::Exit),
        "generate" => match fields.get("request") {
            Some(Value::Object(request)) if request.contains_key("video") => {
                parse_video_command(&fields, request, limits).map(Command::GenerateVideo)
            }
            _ => parse_generate(&fields, limits).map(Command::Generate),
        },
        other => Err(bad(format!(
            "unknown op `{}`; it must be one of load, generate, exit",
            clip(other)
        ))),
    }
}

fn parse_generate(
    fields: &Map<String, Value>,
    limits: &WorkerLimits,
) -> Result<GenerateCommand, RequestError> {
    let id = optional_string(fields, "id")?.unwrap_or_default();
    let image_fields = match fields.get("request") {
        None | Some(Value::Null) => fields,
        Some(Value::Object(request)) => nested_image(request)?,
        Some(other) => {
            return Err(bad(format!(
                "field `request` must be an object like {{\"image\":{{...}}}}, got {}",
                kind_of(other)
            )))
        }
    };
    if !std::ptr::eq(image_fields, fields) && fields.contains_key("prompt") {
        return Err(bad(
            "give the image fields either inside `request.image` or at the top level, not both",
        ));
    }
    let job = parse_image(image_fields, limits)?;
    let count = optional_u32(image_fields, "n")?.unwrap_or(1);
    if count == 0 || count > limits.max_images {
        return Err(bad(format!(
            "field `n` must be 1 to {}, got {count}",
            limits.max_images
        )));
    }
    let target = parse_target(fields, count)?;
    Ok(GenerateCommand {
        id,
        target,
        job,
        count,
    })
}

fn nested_image(request: &Map<String, Value>) -> Result<&Map<String, Value>, RequestError> {
    match request.get("image") {
        Some(Value::Object(image)) => Ok(image),
        Some(other) => Err(bad(format!(
            "field `request.image` must be an object, got {}",
            kind_of(other)
        ))),
        None => Err(bad(
            "field `request` must hold an `image` object: {\"request\":{\"image\":{\"prompt\":...}}}",
        )),
    }
}

fn parse_image(
    fields: &Map<String, Value>,
    limits: &WorkerLimits,
) -> Result<ImageJob, RequestError> {
    let prompt = match fields.get("prompt") {
        Some(Value::String(p)) => p.clone(),
        Some(other) => {
            return Err(bad(format!(
                "field `prompt` must be a string, got {}",
                kind_of(other)
            )))
        }
        None => return Err(bad("field `prompt` is missing")),
    };
    if prompt.len() > limits.max_prompt_bytes {
        return Err(bad(format!(
            "field `prompt` is {} bytes; at most {} are accepted",
            prompt.len(),
            limits.max_prompt_bytes
        )));
    }
    let negative_prompt = optional_string(fields, "negative_prompt")?.filter(|n| !n.is_empty());
    if negative_prompt
        .as_ref()
        .is_some_and(|n| n.len() > limits.max_prompt_bytes)
    {
        return Err(bad(format!(
            "field `negative_prompt` is longer than {} bytes",
            limits.max_prompt_bytes
        )));
    }
    let width = optional_u32(fields, "width")?.unwrap_or(limits.default_side);
    let height = optional_u32(fields, "height")?.unwrap_or(limits.default_side);
    // Only the worker's generic bound here: the multiple a size must be of is the model's (Qwen-Image 32, MiniMax
    // H3 its folder's canvas multiple), and its engine refuses other sizes naming that rule.
    for (name, side) in [("width", width), ("height", height)] {
        if side < limits.min_side || side > limits.max_side {
            return Err(bad(format!(
                "field `{name}` must be {} to {} pixels (the worker's bound; the engine's own size rule comes on \
                 top), got {side}",
                limits.min_side, limits.max_side
            )));
        }
    }
    // 0 means "the engine's default", as LocalRouter sends it.
    let steps = optional_u32(fields, "steps")?.filter(|&s| s != 0);
    if let Some(steps) = steps {
        if steps > limits.max_steps {
            return Err(bad(format!(
                "field `steps` must be at most {}, got {steps}",
                limits.max_steps
            )));
        }
    }
    let seed = optional_u64(fields, "seed")?.unwrap_or(0);
    let guidance = optional_f32(fields, "guidance")?.filter(|&g| g != 0.0);
    if let Some(g) = guidance {
        if !(g.is_finite() && g > 0.0) {
            return Err(bad(format!(
                "field `guidance` must be a positive number, got {g}"
            )));
        }
    }
    if let Some(Value::Array(refs)) = fields.get("references") {
        if !refs.is_empty() {
            return Err(bad(
                "this engine makes images from text only; `references` (image edits) are not supported",
            ));
        }
    }
    Ok(ImageJob {
        prompt,
        negative_prompt,
        width,
        height,
        steps,
        seed,
        guidance,
    })
}

fn parse_video_command(
    fields: &Map<String, Value>,
    request: &Map<String, Value>,
    limits: &WorkerLimits,
) -> Result<VideoCommand, RequestError> {
    let id = optional_string(fields, "id")?.unwrap_or_default();
    if request.contains_key("image") {
        return Err(bad(
            "give either `request.image` or `request.video`, not both",
        ));
    }
    let video = match request.get("video") {
        Some(Value::Object(v)) => v,
        Some(other) => {
            return Err(bad(format!(
                "field `request.video` must be an object, got {}",
                kind_of(other)
            )))
        }
        None => return Err(bad("field `request.video` is missing")),
    };
    let job = parse_video(video, limits)?;
    let dir = match parse_target(fields, 1)? {
        OutputTarget::Folder(dir) => dir,
        OutputTarget::File(_) => {
            return Err(bad(
                "a video is written as several files: give a folder in `dir` (or `out_dir`), not `output`",
            ))
        }
    };
    Ok(VideoCommand { id, dir, job })
}

/// Parses `request.video`: the image fields (`prompt`, sizes, steps, seed, guidance) with the same rules, plus
/// `seconds`, `fps`, `audio` and `first_frame`.
fn parse_video(
    fields: &Map<String, Value>,
    limits: &WorkerLimits,
) -> Result<VideoJob, RequestError> {
    let image = parse_image(fields, limits)?;
    let seconds = optional_f32(fields, "seconds")?.unwrap_or(5.0);
    if !(seconds.is_finite() && seconds > 0.0 && seconds <= MAX_VIDEO_SECONDS) {
        return Err(bad(format!(
            "field `seconds` must be above 0 and at most {MAX_VIDEO_SECONDS}, got {seconds}"
        )));
    }
    let fps = optional_u32(fields, "fps")?.unwrap_or(24);
    if fps == 0 || fps > MAX_FPS {
        return Err(bad(format!(
            "field `fps` must be 1 to {MAX_FPS}, got {fps}"
        )));
    }
    let audio = match fields.get("audio") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(bad(format!(
                "field `audio` must be true or false, got {}",
                kind_of(other)
            )))
        }
    };
    let first_frame = optional_string(fields, "first_frame")?
        .filter(|f| !f.is_empty())
        .map(PathBuf::from);
    Ok(VideoJob {
        prompt: image.prompt,
        negative_prompt: image.negative_prompt,
        width: image.width,
        height: image.height,
        seconds,
        fps,
        seed: image.seed,
        steps: image.steps,
        guidance: image.guidance,
        audio,
        first_frame,
    })
}

fn parse_target(fields: &Map<String, Value>, count: u32) -> Result<OutputTarget, RequestError> {
    let dir = optional_string(fields, "dir")?.filter(|d| !d.is_empty());
    let out_dir = optional_string(fields, "out_dir")?.filter(|d| !d.is_empty());
    let output = optional_string(fields, "output")?.filter(|d| !d.is_empty());
    match (dir, out_dir, output) {
        (Some(d), None, None) | (None, Some(d), None) => Ok(OutputTarget::Folder(PathBuf::from(d))),
        (None, None, Some(file)) if count == 1 => Ok(OutputTarget::File(PathBuf::from(file))),
        (None, None, Some(_)) => Err(bad(format!(
            "field `output` names one file, but n is {count}; give a folder in `dir` instead"
        ))),
        (None, None, None) => Err(bad(
            "say where the images go: `dir` (or `out_dir`) for a folder, or `output` for one file",
        )),
        _ => Err(bad("give only one of `dir`, `out_dir` and `output`")),
    }
}

fn optional_string(
    fields: &Map<String, Value>,
    name: &str,
) -> Result<Option<String>, RequestError> {
    match fields.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(bad(format!(
            "field `{name}` must be a string, got {}",
            kind_of(other)
        ))),
    }
}

fn optional_u64(fields: &Map<String, Value>, name: &str) -> Result<Option<u64>, RequestError> {
    match fields.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n.as_u64().map(Some).ok_or_else(|| {
            bad(format!(
                "field `{name}` must be a whole number from 0 to {}, got {n}",
                u64::MAX
            ))
        }),
        Some(other) => Err(bad(format!(
            "field `{name}` must be a whole number, got {}",
            kind_of(other)
        ))),
    }
}

fn optional_u32(fields: &Map<String, Value>, name: &str) -> Result<Option<u32>, RequestError> {
    match optional_u64(fields, name)? {
        None => Ok(None),
        Some(v) => u32::try_from(v).map(Some).map_err(|_| {
            bad(format!(
                "field `{name}` must be at most {}, got {v}",
                u32::MAX
            ))
        }),
    }
}

fn optional_f32(fields: &Map<String, Value>, name: &str) -> Result<Option<f32>, RequestError> {
    match fields.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_f64()
            .map(|v| Some(v as f32))
            .ok_or_else(|| bad(format!("field `{name}` must be a number, got {n}"))),
        Some(other) => Err(bad(format!(
            "field `{name}` must be a number, got {}",
            kind_of(other)
        ))),
    }
}

/// At most 64 characters of sender text in an error message.
fn clip(text: &str) -> String {
    let mut clipped: String = text.chars().take(64).collect();
    if clipped.len() < text.len() {
        clipped.push('…');
    }
    clipped
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> WorkerLimits {
        WorkerLimits::default()
    }

    fn generate(line: &str) -> Result<GenerateCommand, RequestError> {
        match parse_command(line, &limits())? {
            Command::Generate(g) => Ok(g),
            other => panic!("expected generate, got {other:?}"),
        }
    }

    #[test]
    fn load_and_exit_parse() {
        assert_eq!(
            parse_command(r#"{"op":"load"}"#, &limits()),
            Ok(Command::Load)
        );
        assert_eq!(
            parse_command(r#"{"op":"exit","x":1}"#, &limits()),
            Ok(Command::Exit)
        );
    }

    #[test]
    fn localrouter_shape_parses_with_defaults() {
        let g = generate(
            r#"{"op":"generate","id":"img_1","dir":"/tmp/j","request":{"image":{"prompt":"fox","seed":7,"steps":0,"guidance":0,"n":2,"references":[]}}}"#,
        )
        .unwrap();
        assert_eq!(g.id, "img_1");
        assert_eq!(g.target, OutputTarget::Folder(PathBuf::from("/tmp/j")));
        assert_eq!(g.count, 2);
        assert_eq!(g.job.prompt, "fox");
        assert_eq!(g.job.seed, 7);
        assert_eq!(g.job.steps, None);
        assert_eq!(g.job.guidance, None);
        assert_eq!((g.job.width, g.job.height), (1024, 1024));
    }

    #[test]
    fn flat_shape_parses() {
        let g = generate(
            r#"{"op":"generate","prompt":"a","negative_prompt":"b","width":64,"height":96,"steps":3,"seed":18446744073709551615,"output":"x.png"}"#,
        )
        .unwrap();
        assert_eq!(g.target, OutputTarget::File(PathBuf::from("x.png")));
        assert_eq!(g.job.negative_prompt.as_deref(), Some("b"));
        assert_eq!((g.job.width, g.job.height, g.job.steps), (64, 96, Some(3)));
        assert_eq!(g.job.seed, u64::MAX);
    }

    #[test]
    fn bad_fields_name_the_field() {
        let cases = [
            (r#"{"op":"generate","out_dir":"o"}"#, "`prompt` is missing"),
            (
                r#"{"op":"generate","prompt":3,"out_dir":"o"}"#,
                "`prompt` must be a string",
            ),
            (
                r#"{"op":"generate","prompt":"a","width":"64","out_dir":"o"}"#,
                "`width` must be a whole number",
            ),
            (
                r#"{"op":"generate","prompt":"a","width":-64,"out_dir":"o"}"#,
                "`width` must be a whole number",
            ),
            (
                r#"{"op":"generate","prompt":"a","width":65.5,"out_dir":"o"}"#,
                "`width` must be a whole number",
            ),
            (
                r#"{"op":"generate","prompt":"a","width":4096,"out_dir":"o"}"#,
                "`width` must be 1 to 2048 pixels (the worker's bound",
            ),
            (
                r#"{"op":"generate","prompt":"a","height":0,"out_dir":"o"}"#,
                "`height` must be 1 to 2048 pixels",
            ),
            (
                r#"{"op":"generate","prompt":"a","height":99999999999,"out_dir":"o"}"#,
                "`height` must be at most",
            ),
            (
                r#"{"op":"generate","prompt":"a","steps":100000,"out_dir":"o"}"#,
                "`steps` must be at most",
            ),
            (
                r#"{"op":"generate","prompt":"a","seed":-1,"out_dir":"o"}"#,
                "`seed` must be a whole number",
            ),
            (
                r#"{"op":"generate","prompt":"a","n":0,"out_dir":"o"}"#,
                "`n` must be 1 to",
            ),
            (
                r#"{"op":"generate","prompt":"a"}"#,
                "say where the images go",
            ),
            (
                r#"{"op":"generate","prompt":"a","n":2,"output":"a.png"}"#,
                "names one file",
            ),
            (
                r#"{"op":"generate","prompt":"a","dir":"a","output":"a.png"}"#,
                "only one of",
            ),
            (
                r#"{"op":"generate","prompt":"a","guidance":-1,"out_dir":"o"}"#,
                "`guidance` must be a positive",
            ),
            (
                r#"{"op":"generate","prompt":"a","references":["r.png"],"out_dir":"o"}"#,
                "references",
            ),
            (
                r#"{"op":"generate","dir":"d","request":{"video":{"prompt":"a","seconds":0}}}"#,
                "`seconds` must be above 0",
            ),
            (
                r#"{"op":"generate","dir":"d","request":{"video":{"prompt":"a","fps":1000}}}"#,
                "`fps` must be 1 to",
            ),
            (
                r#"{"op":"generate","dir":"d","request":{"video":{"prompt":"a","audio":"yes"}}}"#,
                "`audio` must be true or false",
            ),
            (
                r#"{"op":"generate","output":"v.mp4","request":{"video":{"prompt":"a"}}}"#,
                "several files",
            ),
            (
                r#"{"op":"generate","dir":"d","request":{"video":3}}"#,
                "`request.video` must be an object",
            ),
            (
                r#"{"op":"generate","dir":"d","request":[]}"#,
                "`request` must be an object",
            ),
            (
                r#"{"op":"generate","dir":"d","prompt":"a","request":{"image":{"prompt":"b"}}}"#,
                "not both",
            ),
            (r#"{"op":"dance"}"#, "unknown op `dance`"),
            (r#"{"op":1}"#, "`op` must be a string"),
            (r#"{}"#, "`op` is missing"),
            (r#"[1]"#, "expected a JSON object"),
            (r#"{"op":"load""#, "not valid JSON"),
        ];
        for (line, expected) in cases {
            let err = parse_command(line, &limits()).expect_err(line);
            assert!(err.0.contains(expected), "{line}: {err}");
        }
    }

    #[test]
    fn video_requests_parse_into_a_typed_job() {
        let line = r#"{"op":"generate","id":"v1","dir":"/tmp/v","request":{"video":{"prompt":"waves","width":64,"height":32,"seconds":2.5,"fps":8,"seed":3,"steps":4,"guidance":5,"audio":true,"first_frame":"f.png"}}}"#;
        let Command::GenerateVideo(v) = parse_command(line, &limits()).unwrap() else {
            panic!("expected a video command");
        };
        assert_eq!(v.id, "v1");
        assert_eq!(v.dir, PathBuf::from("/tmp/v"));
        assert_eq!(
            v.job,
            VideoJob {
                prompt: "waves".into(),
                negative_prompt: None,
                width: 64,
                height: 32,
                seconds: 2.5,
                fps: 8,
                seed: 3,
                steps: Some(4),
                guidance: Some(5.0),
                audio: true,
                first_frame: Some(PathBuf::from("f.png")),
            }
        );
        assert_eq!(v.job.frames(), 20);
        let line = r#"{"op":"generate","dir":"d","request":{"video":{"prompt":"a"}}}"#;
        let Command::GenerateVideo(v) = parse_command(line, &limits()).unwrap() else {
            panic!("expected a video command");
        };
        assert_eq!((v.job.seconds, v.job.fps, v.job.audio), (5.0, 24, false));
    }

    #[test]
    fn sizes_off_the_old_multiple_of_16_pass_to_the_engine() {
        // The README's MiniMax H3 fixture size (16x24): the H3 engine decides by its folder's canvas multiple.
        let line = r#"{"op":"generate","dir":"d","request":{"video":{"prompt":"waves","width":16,"height":24,"seconds":0.9}}}"#;
        let Command::GenerateVideo(v) = parse_command(line, &limits()).unwrap() else {
            panic!("expected a video command");
        };
        assert_eq!((v.job.width, v.job.height), (16, 24));
        let g = generate(r#"{"op":"generate","prompt":"a","width":72,"height":40,"out_dir":"o"}"#)
            .unwrap();
        assert_eq!((g.job.width, g.job.height), (72, 40));
        // The generic bound still holds, and says it is the worker's.
        let line = r#"{"op":"generate","dir":"d","request":{"video":{"prompt":"waves","width":16,"height":2056}}}"#;
        let err = parse_command(line, &limits()).unwrap_err();
        assert!(
            err.0
                .contains("`height` must be 1 to 2048 pixels (the worker's bound"),
            "{err}"
        );
    }

    #[test]
    fn long_unknown_op_is_clipped() {
        let line = format!(r#"{{"op":"{}"}}"#, "x".repeat(1000));
        let err = parse_command(&line, &limits()).unwrap_err();
        assert!(err.0.len() < 200, "{}", err.0.len());
    }

    proptest::proptest! {
        #[test]
        fn any_text_parses_or_errors_without_panicking(line in "\\PC{0,200}") {
            let _ = parse_command(&line, &limits());
        }

        #[test]
        fn valid_sizes_are_kept_and_others_refused(w in 0u32..5000, h in 0u32..5000) {
            let line = format!(r#"{{"op":"generate","prompt":"p","width":{w},"height":{h},"out_dir":"o"}}"#);
            let l = limits();
            let ok = |s: u32| s >= l.min_side && s <= l.max_side;
            match parse_command(&line, &l) {
                Ok(Command::Generate(g)) => {
                    proptest::prop_assert!(ok(w) && ok(h));
                    proptest::prop_assert_eq!((g.job.width, g.job.height), (w, h));
                }
                Ok(other) => proptest::prop_assert!(false, "{:?}", other),
                Err(_) => proptest::prop_assert!(!(ok(w) && ok(h))),
            }
        }
    }
}
