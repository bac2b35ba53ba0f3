//! Stand-in NCCL libraries for host tests (Linux, LP64: C `long` is `i64`), built from C with the C compiler the Rust toolchain already links
//! with (`$CC`, else `cc`): one that exports only two entry points, and a full fake whose asynchronous state,
//! call log and counters the tests drive through `fake_set` / `fake_get` / `fake_log`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// Exports `ncclGetVersion` and `ncclGetErrorString` only.
pub const PARTIAL_SOURCE: &str = r#"
int ncclGetVersion(int* v) { *v = 22803; return 0; }
const char* ncclGetErrorString(int r) { (void)r; return "partial"; }
"#;

/// Every entry of the table. Handles are the address of a static; nothing touches device memory.
pub const FAKE_SOURCE: &str = r#"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { char internal[128]; } id_t_;
typedef struct { size_t size; unsigned magic; unsigned version; int blocking; } cfg_head;

static long v_version, v_init_polls, v_init_error, v_op_polls, v_op_error, v_finalize_polls;
static long pending, pending_error;
static long n_init, n_abort, n_destroy, n_finalize, n_send, n_recv, n_gather, n_reduce, n_bcast;
static long n_gstart, n_gend, n_async, n_unique;
static long seen_blocking, seen_size, seen_magic, seen_version, seen_nvls, seen_world, seen_rank, seen_id_ok;
static int the_comm;

static struct { const char* name; long* slot; } keys[] = {
    {"version", &v_version}, {"init_polls", &v_init_polls}, {"init_error", &v_init_error},
    {"op_polls", &v_op_polls}, {"op_error", &v_op_error}, {"finalize_polls", &v_finalize_polls},
    {"pending", &pending}, {"pending_error", &pending_error},
    {"init", &n_init}, {"abort", &n_abort}, {"destroy", &n_destroy}, {"finalize", &n_finalize},
    {"send", &n_send}, {"recv", &n_recv}, {"gather", &n_gather}, {"reduce", &n_reduce}, {"bcast", &n_bcast},
    {"group_start", &n_gstart}, {"group_end", &n_gend}, {"async", &n_async}, {"unique", &n_unique},
    {"blocking", &seen_blocking}, {"size", &seen_size}, {"magic", &seen_magic}, {"config_version", &seen_version},
    {"nvls", &seen_nvls}, {"world", &seen_world}, {"rank", &seen_rank}, {"id_ok", &seen_id_ok},
};

#define LOG 256
static struct { long kind; uint64_t a; uint64_t b; long count; long peer; long dtype; long op; } entries[LOG];
static long n_log;

static void note(long kind, const void* a, const void* b, size_t count, long peer, long dtype, long op) {
    if (n_log < LOG) {
        entries[n_log].kind = kind; entries[n_log].a = (uint64_t)(uintptr_t)a; entries[n_log].b = (uint64_t)(uintptr_t)b;
        entries[n_log].count = (long)count; entries[n_log].peer = peer; entries[n_log].dtype = dtype; entries[n_log].op = op;
    }
    n_log++;
}

void fake_reset(void) {
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) *keys[i].slot = 0;
    v_version = 22803; seen_blocking = -1; seen_nvls = -2; n_log = 0;
}
long fake_get(const char* k) {
    if (strcmp(k, "log_len") == 0) return n_log;
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) if (strcmp(keys[i].name, k) == 0) return *keys[i].slot;
    return -999;
}
int fake_set(const char* k, long v) {
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) if (strcmp(keys[i].name, k) == 0) { *keys[i].slot = v; return 0; }
    return -1;
}
/* kind: 1 send, 2 recv, 3 all-gather, 4 all-reduce, 5 broadcast. */
int fake_log(long i, long* kind, uint64_t* a, uint64_t* b, long* count, long* peer, long* dtype) {
    if (i < 0 || i >= n_log || i >= LOG) return -1;
    *kind = entries[i].kind; *a = entries[i].a; *b = entries[i].b; *count = entries[i].count;
    *peer = entries[i].peer; *dtype = entries[i].dtype;
    return 0;
}

static int start_op(void) { pending = v_op_polls; pending_error = v_op_error; return pending != 0 ? 7 : 0; }

int ncclGetVersion(int* v) { *v = (int)v_version; return 0; }
const char* ncclGetErrorString(int r) {
    switch (r) { case 0: return "no error"; case 6: return "remote process exited or there was a network error";
                 case 7: return "NCCL operation in progress"; default: return "fake error"; }
}
const char* ncclGetLastError(void* c) { (void)c; return "fake last error"; }
int ncclGetUniqueId(id_t_* id) { n_unique++; for (int i = 0; i < 128; i++) id->internal[i] = (char)(i * 3); return 0; }
int ncclCommInitRankConfig(void** comm, int world, id_t_ id, int rank, cfg_head* cfg) {
    n_init++;
    const char* e = getenv("NCCL_NVLS_ENABLE");
    seen_nvls = e ? atol(e) : -1;
    seen_size = (long)cfg->size; seen_magic = (long)cfg->magic; seen_version = (long)cfg->version;
    seen_blocking = cfg->blocking; seen_world = world; seen_rank = rank;
    seen_id_ok = id.internal[5] == (char)15 && id.internal[100] == (char)300;
    if (cfg->magic != 0xcafebeefu) return 4;
    *comm = &the_comm;
    pending = v_init_polls; pending_error = v_init_error;
    return cfg->blocking == 0 ? 7 : 0;
}
int ncclCommGetAsyncError(void* comm, int* state) {
    (void)comm; n_async++;
    if (pending < 0) { *state = 7; return 0; }
    if (pending > 0) { pending--; *state = 7; return 0; }
    *state = (int)pending_error;
    return 0;
}
int ncclCommFinalize(void* c) { (void)c; n_finalize++; pending = v_finalize_polls; pending_error = 0; return 7; }
int ncclCommDestroy(void* c) { (void)c; n_destroy++; return 0; }
int ncclCommAbort(void* c) { (void)c; n_abort++; return 0; }
int ncclGroupStart(void) { n_gstart++; return 0; }
int ncclGroupEnd(void) { n_gend++; return start_op(); }
int ncclSend(const void* b, size_t n, int t, int peer, void* c, void* s) { (void)c; (void)s; n_send++; note(1, b, 0, n, peer, t, 0); return 0; }
int ncclRecv(void* b, size_t n, int t, int peer, void* c, void* s) { (void)c; (void)s; n_recv++; note(2, b, 0, n, peer, t, 0); return 0; }
int ncclAllGather(const void* a, void* b, size_t n, int t, void* c, void* s) { (void)c; (void)s; n_gather++; note(3, a, b, n, -1, t, 0); return start_op(); }
int ncclAllReduce(const void* a, void* b, size_t n, int t, int op, void* c, void* s) { (void)c; (void)s; n_reduce++; note(4, a, b, n, -1, t, op); return start_op(); }
int ncclBroadcast(const void* a, void* b, size_t n, int t, int root, void* c, void* s) { (void)c; (void)s; n_bcast++; note(5, a, b, n, root, t, 0); return start_op(); }
"#;

/// Compiles `source` into `lib<name>.so` under the test target's scratch folder and returns its path.
pub fn build_library(name: &str, source: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tf-nccl-fakes");
    std::fs::create_dir_all(&dir).expect("create the scratch folder");
    let src = dir.join(format!("{name}.c"));
    let out = dir.join(format!("lib{name}.so"));
    std::fs::write(&src, source).expect("write the C source");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("run {cc} (the C compiler the Rust toolchain links with): {e}"));
    assert!(status.success(), "{cc} failed on {}", src.display());
    out
}

/// The fake's controls, through its own handle (the same loaded instance as the loader's: one path, one
/// library).
pub struct Fake {
    lib: libloading::Library,
    pub path: PathBuf,
}

type GetFn = unsafe extern "C" fn(*const std::ffi::c_char) -> i64;
type SetFn = unsafe extern "C" fn(*const std::ffi::c_char, i64) -> std::ffi::c_int;
type ResetFn = unsafe extern "C" fn();
type LogFn = unsafe extern "C" fn(
    i64,
    *mut i64,
    *mut u64,
    *mut u64,
    *mut i64,
    *mut i64,
    *mut i64,
) -> std::ffi::c_int;

/// One logged NCCL call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Logged {
    pub kind: i64,
    pub a: u64,
    pub b: u64,
    pub count: i64,
    pub peer: i64,
    pub dtype: i64,
}

impl Fake {
    pub fn open(path: &Path) -> Fake {
        // SAFETY: the fake's initialisers are empty.
        let lib = unsafe { libloading::Library::new(path) }.expect("open the fake NCCL");
        let fake = Fake {
            lib,
            path: path.to_path_buf(),
        };
        fake.reset();
        fake
    }

    pub fn reset(&self) {
        // SAFETY: declared in FAKE_SOURCE with this signature.
        unsafe { (self.lib.get::<ResetFn>(b"fake_reset\0").unwrap())() }
    }

    pub fn get(&self, key: &str) -> i64 {
        let k = std::ffi::CString::new(key).unwrap();
        // SAFETY: declared in FAKE_SOURCE with this signature; the key outlives the call.
        let v = unsafe { (self.lib.get::<GetFn>(b"fake_get\0").unwrap())(k.as_ptr()) };
        assert_ne!(v, -999, "unknown fake key {key}");
        v
    }

    pub fn set(&self, key: &str, value: i64) {
        let k = std::ffi::CString::new(key).unwrap();
        // SAFETY: as above.
        let r = unsafe { (self.lib.get::<SetFn>(b"fake_set\0").unwrap())(k.as_ptr(), value) };
        assert_eq!(r, 0, "unknown fake key {key}");
    }

    pub fn log(&self) -> Vec<Logged> {
        let n = self.get("log_len");
        // SAFETY: declared in FAKE_SOURCE with this signature.
        let f = unsafe { self.lib.get::<LogFn>(b"fake_log\0").unwrap() };
        (0..n)
            .map(|i| {
                let (mut kind, mut a, mut b, mut count, mut peer, mut dtype) = (0, 0, 0, 0, 0, 0);
                // SAFETY: out-pointers to locals.
                let r = unsafe {
                    f(
                        i, &mut kind, &mut a, &mut b, &mut count, &mut peer, &mut dtype,
                    )
                };
                assert_eq!(r, 0);
                Logged {
                    kind,
                    a,
                    b,
                    count,
                    peer,
                    dtype,
                }
            })
            .collect()
    }
}
