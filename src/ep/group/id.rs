//! The NCCL unique id that joins the ranks of one EP group, how it travels between processes
//! (a file rank 0 writes, [`EpGroupId::write_file`] / [`EpGroupId::wait_for_file`]) and the
//! launch environment ([`EpEnv`]). Nothing here needs a GPU; only [`EpGroupId::new`] needs
//! libnccl.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cudarc::nccl::result;

use super::library::{nccl_error, nccl_version};
use crate::{Error, Result};

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const EP_GROUP_ID_BYTES: usize = 128;

/// The NCCL unique id of one EP group: made once (by rank 0), given to every rank, used once
/// to connect them ([`super::EpGroup::from_id`]). It holds rank 0's bootstrap address, so an
/// id is good for one group of one run.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct EpGroupId {
    bytes: [u8; EP_GROUP_ID_BYTES],
}

impl fmt::Debug for EpGroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The first bytes tell ids apart; all 128 would only bury the rest of a message.
        write!(f, "EpGroupId({}..)", hex(&self.bytes[..8]))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl EpGroupId {
    /// A fresh id from NCCL (`ncclGetUniqueId`: it opens rank 0's bootstrap socket).
    /// [`Error::Nccl`] when libnccl is missing. NCCL's bootstrap thread for the id runs until a
    /// group is formed with it, or else until the process exits: make an id only for a group
    /// that will be formed.
    pub fn new() -> Result<EpGroupId> {
        nccl_version()?;
        let id = result::get_uniqueid().map_err(|e| nccl_error("EpGroupId::new", e, None))?;
        Ok(EpGroupId { bytes: id.internal.map(|c| c as u8) })
    }

    pub fn to_bytes(&self) -> [u8; EP_GROUP_ID_BYTES] {
        self.bytes
    }

    /// The id from its [`EP_GROUP_ID_BYTES`] bytes (as [`Self::to_bytes`] gave them, e.g. sent
    /// by the launcher's own channel); [`Error::InvalidArgument`] for another length.
    pub fn from_bytes(bytes: &[u8]) -> Result<EpGroupId> {
        let bytes = bytes.try_into().map_err(|_| Error::InvalidArgument {
            op: "EpGroupId::from_bytes",
            why: format!("an NCCL unique id is {EP_GROUP_ID_BYTES} bytes, got {}", bytes.len()),
        })?;
        Ok(EpGroupId { bytes })
    }

    /// The id as 256 lowercase hex digits: the id file's content, safe in an environment
    /// variable too.
    pub fn to_hex(&self) -> String {
        hex(&self.bytes)
    }

    /// The id from [`Self::to_hex`]'s text (surrounding whitespace ignored).
    pub fn from_hex(text: &str) -> Result<EpGroupId> {
        let text = text.trim();
        let bad = |why: String| Error::InvalidArgument { op: "EpGroupId::from_hex", why };
        if text.len() != 2 * EP_GROUP_ID_BYTES || !text.is_ascii() {
            return Err(bad(format!(
                "an NCCL unique id is {} hex digits, got {} characters",
                2 * EP_GROUP_ID_BYTES,
                text.chars().count()
            )));
        }
        let mut bytes = [0u8; EP_GROUP_ID_BYTES];
        for (i, byte) in bytes.iter_mut().enumerate() {
            let pair = &text[2 * i..2 * i + 2];
            *byte =
                u8::from_str_radix(pair, 16).map_err(|_| bad(format!("'{pair}' at offset {} is not hex", 2 * i)))?;
        }
        Ok(EpGroupId { bytes })
    }

    pub(crate) fn to_nccl(self) -> cudarc::nccl::sys::ncclUniqueId {
        cudarc::nccl::sys::ncclUniqueId { internal: self.bytes.map(|b| b as std::ffi::c_char) }
    }

    /// Rank 0's side of the id file: writes [`Self::to_hex`] to `path` atomically (a temporary
    /// file in the same folder, then a rename), so a rank polling `path` reads the whole id or
    /// nothing. Refuses a `path` that exists: it would be an id of an earlier run (the ranks
    /// that read it would wait for a rank 0 that is gone), so use a fresh path per run or
    /// remove it. [`super::EpGroup::from_id_file`] removes it once every rank has joined.
    pub fn write_file(&self, path: &Path) -> Result<()> {
        const OP: &str = "EpGroupId::write_file";
        let io = |what: &str, e: std::io::Error| Error::Nccl { op: OP, why: format!("{what} {}: {e}", path.display()) };
        if path.exists() {
            return Err(Error::Nccl {
                op: OP,
                why: format!(
                    "{} exists already (an id file of an earlier run?): remove it, or give each run a fresh path",
                    path.display()
                ),
            });
        }
        let temporary = temporary_path(path);
        let written = std::fs::write(&temporary, format!("{}\n", self.to_hex()))
            .and_then(|()| std::fs::File::open(&temporary)?.sync_all())
            .and_then(|()| std::fs::rename(&temporary, path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&temporary);
            return Err(io("writing", e));
        }
        Ok(())
    }

    /// The other ranks' side of the id file: polls `path` until it holds an id or `timeout`
    /// has passed ([`Error::Nccl`] then, naming the path, the time waited and the last thing
    /// found there).
    pub fn wait_for_file(path: &Path, timeout: Duration) -> Result<EpGroupId> {
        const POLL: Duration = Duration::from_millis(20);
        let start = Instant::now();
        let mut last = String::from("no file there");
        loop {
            match std::fs::read_to_string(path) {
                Ok(text) => match EpGroupId::from_hex(&text) {
                    Ok(id) => return Ok(id),
                    // Only a non-atomic writer leaves a partial id: wait for the rest.
                    Err(e) => last = format!("its content is not an id ({e})"),
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => last = format!("reading it failed ({e})"),
            }
            if start.elapsed() >= timeout {
                return Err(Error::Nccl {
                    op: "EpGroupId::wait_for_file",
                    why: format!(
                        "no NCCL id at {} after {:.1} s ({last}): did rank 0 start, with the same path? It writes the file",
                        path.display(),
                        timeout.as_secs_f64()
                    ),
                });
            }
            std::thread::sleep(POLL.min(timeout.saturating_sub(start.elapsed())));
        }
    }
}

/// A name beside `path` that no other process picks: `path` + `.tmp.<pid>.<nanos>`.
fn temporary_path(path: &Path) -> PathBuf {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".tmp.{}.{nanos}", std::process::id()));
    PathBuf::from(name)
}

/// How a process of a multi-process EP run finds its group, from the environment:
///
/// | variable                 | meaning                                                     |
/// |--------------------------|-------------------------------------------------------------|
/// | `CAPMOE_EP_RANK`         | this process's rank, `0 ..= CAPMOE_EP_SIZE - 1`              |
/// | `CAPMOE_EP_SIZE`         | R, the ranks of the group                                   |
/// | `CAPMOE_EP_ID_FILE`      | the id file rank 0 writes and the others read (fresh per run, on a file system all ranks see) |
/// | `CAPMOE_EP_ID_TIMEOUT_S` | optional: how long ranks > 0 wait for it (default 300)      |
#[derive(Clone, Debug, PartialEq)]
pub struct EpEnv {
    pub rank: usize,
    pub ranks: usize,
    pub id_file: PathBuf,
    pub timeout: Duration,
}

impl EpEnv {
    pub const RANK: &'static str = "CAPMOE_EP_RANK";
    pub const SIZE: &'static str = "CAPMOE_EP_SIZE";
    pub const ID_FILE: &'static str = "CAPMOE_EP_ID_FILE";
    pub const ID_TIMEOUT_S: &'static str = "CAPMOE_EP_ID_TIMEOUT_S";
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

    /// Reads the process environment.
    pub fn from_env() -> Result<EpEnv> {
        EpEnv::parse(|name| std::env::var(name).ok())
    }

    /// Parses variables looked up by `var` (the environment, or a map in a test);
    /// [`Error::InvalidArgument`] naming the variable that is missing or wrong.
    pub fn parse(var: impl Fn(&str) -> Option<String>) -> Result<EpEnv> {
        const OP: &str = "EpEnv::parse";
        let bad = |why: String| Error::InvalidArgument { op: OP, why };
        let required = |name: &str| {
            var(name).filter(|v| !v.trim().is_empty()).ok_or_else(|| {
                bad(format!(
                    "{name} is not set (an EP process needs {}, {} and {})",
                    EpEnv::RANK,
                    EpEnv::SIZE,
                    EpEnv::ID_FILE
                ))
            })
        };
        let number = |name: &str, text: String| {
            text.trim().parse::<usize>().map_err(|_| bad(format!("{name} = '{text}' is not a non-negative integer")))
        };
        let rank = number(EpEnv::RANK, required(EpEnv::RANK)?)?;
        let ranks = number(EpEnv::SIZE, required(EpEnv::SIZE)?)?;
        if ranks == 0 || ranks > i32::MAX as usize {
            return Err(bad(format!("{} = {ranks} must be in 1 ..= {}", EpEnv::SIZE, i32::MAX)));
        }
        if rank >= ranks {
            return Err(bad(format!("{} = {rank} must be below {} = {ranks}", EpEnv::RANK, EpEnv::SIZE)));
        }
        let id_file = PathBuf::from(required(EpEnv::ID_FILE)?);
        let timeout = match var(EpEnv::ID_TIMEOUT_S) {
            None => EpEnv::DEFAULT_TIMEOUT,
            Some(text) => match text.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && s >= 0.0 => Duration::from_secs_f64(s),
                _ => return Err(bad(format!("{} = '{text}' is not a number of seconds >= 0", EpEnv::ID_TIMEOUT_S))),
            },
        };
        Ok(EpEnv { rank, ranks, id_file, timeout })
    }
}
