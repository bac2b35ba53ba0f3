//! Errors of the copy-source bookkeeping.

/// Why a copy-source operation failed. `E` is the backend's error type.
#[derive(Debug, thiserror::Error)]
pub enum Error<E: std::error::Error + 'static> {
    /// A copy would read host memory that no open capture owns while a capture scope is open.
    #[error(
        "{operation} refused: a capture scope is open on stream {stream}, and a captured copy would read host \
         memory the capture does not own (a graph replays the copy later); end or drop the capture first, or copy \
         through a source owned by the capture (async upload on the capturing stream, or CaptureScope::adopt)"
    )]
    UnownedCaptureSource {
        /// The refused operation, e.g. "synchronous upload".
        operation: &'static str,
        /// The stream whose capture scope is open (Debug form of the backend's handle).
        stream: String,
    },
    /// A synchronous copy (a staged download) while a capture scope is open.
    #[error(
        "{operation} refused: a capture scope is open on stream {stream}, and a synchronous copy waits on the \
         device while a stream is captured (the driver refuses that and invalidates the capture); end or drop the \
         capture first"
    )]
    CaptureOpen {
        /// The refused operation, e.g. "synchronous download".
        operation: &'static str,
        /// The stream whose capture scope is open (Debug form of the backend's handle).
        stream: String,
    },
    /// `begin_capture` on a stream that already has an open capture scope.
    #[error(
        "a capture scope is already open on stream {stream}; end or drop it before beginning another capture there"
    )]
    CaptureAlreadyOpen {
        /// The stream (Debug form of the backend's handle).
        stream: String,
    },
    /// The fixed table of contexts is full.
    #[error(
        "the copy-source context table is full ({capacity} contexts a process); tear a context down (unregister \
         it) before creating another"
    )]
    ContextTableFull {
        /// How many contexts the table holds.
        capacity: usize,
    },
    /// A context id that is not (or no longer) registered.
    #[error(
        "context slot {slot} (generation {generation}) is not registered with the copy source; it was torn down \
         or never registered: register the context at init and use the id it returned"
    )]
    UnknownContext {
        /// Slot in the context table.
        slot: usize,
        /// Generation of the id that was given.
        generation: u64,
    },
    /// The configured staging limit would be exceeded even after reaping finished copies and dropping spares.
    #[error(
        "out of staging memory: {requested} more bytes requested with {in_use} bytes in use and a limit of {limit} \
         bytes; synchronize the streams with pending uploads (or raise Config::staging_limit_bytes)"
    )]
    OutOfStaging {
        /// Bytes the operation needed.
        requested: usize,
        /// Bytes of staging held (pending, captured and spare).
        in_use: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The destination range wraps around the 64-bit address space.
    #[error("destination {destination:#x} + {len} bytes overflows the device address space; check the address")]
    AddressOverflow {
        /// The destination address.
        destination: u64,
        /// The copy length.
        len: usize,
    },
    /// A backend (driver) call failed.
    #[error("{call} failed: {source}")]
    Backend {
        /// The backend operation, e.g. "enqueue_copy".
        call: &'static str,
        /// The backend's error.
        #[source]
        source: E,
    },
}

impl<E: std::error::Error + 'static> Error<E> {
    pub(crate) fn backend(call: &'static str) -> impl FnOnce(E) -> Error<E> {
        move |source| Error::Backend { call, source }
    }
}
