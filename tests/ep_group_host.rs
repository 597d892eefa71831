//! The EP group's host side, no GPU needed: the NCCL id's byte and text forms, the id-file
//! protocol between a writer (rank 0) and waiters (the other ranks), the launch environment,
//! and the typed error when libnccl is missing.
#![cfg(feature = "nccl")]

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use capturable_moe::ep::{nccl_version, EpEnv, EpGroupId, EP_GROUP_ID_BYTES};
use capturable_moe::Error;

/// A distinct id without libnccl: NCCL ids are opaque bytes to everything but NCCL.
fn fake_id(seed: u8) -> EpGroupId {
    let bytes: Vec<u8> = (0..EP_GROUP_ID_BYTES).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    EpGroupId::from_bytes(&bytes).unwrap()
}

/// A fresh folder under the system temp folder, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let dir = std::env::temp_dir().join(format!("capmoe-ep-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
    fn entries(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn invalid_argument_why(result: capturable_moe::Result<impl std::fmt::Debug>) -> String {
    match result {
        Err(Error::InvalidArgument { why, .. }) => why,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

fn nccl_why(result: capturable_moe::Result<impl std::fmt::Debug>) -> String {
    match result {
        Err(Error::Nccl { why, .. }) => why,
        other => panic!("expected Error::Nccl, got {other:?}"),
    }
}

// ---------------------------------------------------------------- the id

#[test]
fn id_bytes_and_hex_round_trip_host() {
    for seed in [0u8, 1, 200] {
        let id = fake_id(seed);
        let bytes = id.to_bytes();
        assert_eq!(bytes.len(), EP_GROUP_ID_BYTES);
        assert_eq!(EpGroupId::from_bytes(&bytes).unwrap(), id);
        let hex = id.to_hex();
        assert_eq!(hex.len(), 2 * EP_GROUP_ID_BYTES);
        assert!(hex.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()), "{hex}");
        assert_eq!(EpGroupId::from_hex(&hex).unwrap(), id);
        assert_eq!(EpGroupId::from_hex(&format!("  {}\n", hex.to_uppercase())).unwrap(), id);
    }
    assert_ne!(fake_id(0), fake_id(1));
    // Every byte value survives (c_char is signed on x86: 0x80..=0xff must not be mangled).
    let all: Vec<u8> = (0..EP_GROUP_ID_BYTES).map(|i| (i * 2 + 1) as u8).collect();
    assert_eq!(EpGroupId::from_bytes(&all).unwrap().to_bytes().to_vec(), all);
}

#[test]
fn id_refuses_wrong_lengths_and_non_hex_host() {
    for len in [0, 127, 129, 256] {
        let why = invalid_argument_why(EpGroupId::from_bytes(&vec![7u8; len]));
        assert!(why.contains("128 bytes") && why.contains(&len.to_string()), "{why}");
    }
    let hex = fake_id(3).to_hex();
    let why = invalid_argument_why(EpGroupId::from_hex(&hex[..254]));
    assert!(why.contains("256 hex digits"), "{why}");
    let mut bad = hex.clone();
    bad.replace_range(10..12, "zz");
    let why = invalid_argument_why(EpGroupId::from_hex(&bad));
    assert!(why.contains("'zz'") && why.contains("offset 10"), "{why}");
    // A multi-byte character must be refused, not split.
    let mut unicode = hex[..254].to_string();
    unicode.push('é');
    invalid_argument_why(EpGroupId::from_hex(&unicode));
}

// ---------------------------------------------------------------- the id file

#[test]
fn id_file_reaches_every_waiting_rank_host() {
    let dir = TempDir::new("reach");
    let path = dir.file("ep.id");
    let id = fake_id(42);
    // Three "ranks" wait first; "rank 0" writes 200 ms later.
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let path = path.clone();
            std::thread::spawn(move || EpGroupId::wait_for_file(&path, Duration::from_secs(20)))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    id.write_file(&path).unwrap();
    for w in waiters {
        assert_eq!(w.join().unwrap().unwrap(), id);
    }
    // Only the id is left: the temporary file was renamed, not copied.
    assert_eq!(dir.entries(), vec!["ep.id".to_string()]);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{}\n", id.to_hex()));
}

#[test]
fn id_file_written_before_the_wait_is_read_at_once_host() {
    let dir = TempDir::new("before");
    let path = dir.file("ep.id");
    fake_id(9).write_file(&path).unwrap();
    let start = Instant::now();
    assert_eq!(EpGroupId::wait_for_file(&path, Duration::from_secs(20)).unwrap(), fake_id(9));
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn id_file_of_an_earlier_run_is_refused_host() {
    let dir = TempDir::new("stale");
    let path = dir.file("ep.id");
    fake_id(1).write_file(&path).unwrap();
    let why = nccl_why(fake_id(2).write_file(&path));
    assert!(why.contains("exists already") && why.contains("ep.id"), "{why}");
    // The stale id is untouched and no temporary file is left behind.
    assert_eq!(EpGroupId::wait_for_file(&path, Duration::ZERO).unwrap(), fake_id(1));
    assert_eq!(dir.entries(), vec!["ep.id".to_string()]);
}

#[test]
fn id_file_wait_times_out_with_a_clear_error_host() {
    let dir = TempDir::new("timeout");
    let path = dir.file("never.id");
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let why = nccl_why(EpGroupId::wait_for_file(&path, timeout));
    let waited = start.elapsed();
    assert!(waited >= timeout, "gave up after {waited:?}, before the {timeout:?} timeout");
    assert!(waited < Duration::from_secs(10), "waited {waited:?} for a {timeout:?} timeout");
    assert!(why.contains("never.id") && why.contains("rank 0") && why.contains("no file there"), "{why}");
}

#[test]
fn id_file_with_garbage_is_reported_after_the_timeout_host() {
    let dir = TempDir::new("garbage");
    let path = dir.file("ep.id");
    std::fs::write(&path, "not an id\n").unwrap();
    let why = nccl_why(EpGroupId::wait_for_file(&path, Duration::from_millis(100)));
    assert!(why.contains("not an id") && why.contains("hex digits"), "{why}");
}

#[test]
fn id_file_write_into_a_missing_folder_fails_cleanly_host() {
    let dir = TempDir::new("nofolder");
    let path = dir.file("missing/ep.id");
    let why = nccl_why(fake_id(5).write_file(&path));
    assert!(why.contains("writing") && why.contains("ep.id"), "{why}");
    assert!(dir.entries().is_empty());
}

// ---------------------------------------------------------------- the environment

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |name: &str| map.get(name).cloned()
}

const FULL: [(&str, &str); 3] =
    [("CAPMOE_EP_RANK", "3"), ("CAPMOE_EP_SIZE", "8"), ("CAPMOE_EP_ID_FILE", "/shared/run-17/ep.id")];

#[test]
fn env_parses_a_complete_launch_host() {
    let parsed = EpEnv::parse(env(&FULL)).unwrap();
    assert_eq!(
        parsed,
        EpEnv { rank: 3, ranks: 8, id_file: "/shared/run-17/ep.id".into(), timeout: EpEnv::DEFAULT_TIMEOUT }
    );
    let mut with_timeout = FULL.to_vec();
    with_timeout.push(("CAPMOE_EP_ID_TIMEOUT_S", "2.5"));
    assert_eq!(EpEnv::parse(env(&with_timeout)).unwrap().timeout, Duration::from_millis(2500));
    let single = [("CAPMOE_EP_RANK", "0"), ("CAPMOE_EP_SIZE", "1"), ("CAPMOE_EP_ID_FILE", "x")];
    assert_eq!(EpEnv::parse(env(&single)).unwrap().ranks, 1);
}

#[test]
fn env_names_the_missing_variable_host() {
    for missing in ["CAPMOE_EP_RANK", "CAPMOE_EP_SIZE", "CAPMOE_EP_ID_FILE"] {
        let pairs: Vec<_> = FULL.iter().copied().filter(|(k, _)| *k != missing).collect();
        let why = invalid_argument_why(EpEnv::parse(env(&pairs)));
        assert!(why.starts_with(&format!("{missing} is not set")), "{missing}: {why}");
        // Empty counts as unset.
        let mut empty = pairs.clone();
        empty.push((missing, " "));
        let why = invalid_argument_why(EpEnv::parse(env(&empty)));
        assert!(why.starts_with(&format!("{missing} is not set")), "{missing} empty: {why}");
    }
}

#[test]
fn env_refuses_bad_values_host() {
    let cases: &[(&str, &str, &str)] = &[
        ("CAPMOE_EP_RANK", "-1", "not a non-negative integer"),
        ("CAPMOE_EP_RANK", "two", "not a non-negative integer"),
        ("CAPMOE_EP_SIZE", "8.0", "not a non-negative integer"),
        ("CAPMOE_EP_SIZE", "0", "must be in 1 ..="),
        ("CAPMOE_EP_RANK", "8", "must be below CAPMOE_EP_SIZE = 8"),
        ("CAPMOE_EP_ID_TIMEOUT_S", "-3", "not a number of seconds"),
        ("CAPMOE_EP_ID_TIMEOUT_S", "soon", "not a number of seconds"),
        ("CAPMOE_EP_ID_TIMEOUT_S", "inf", "not a number of seconds"),
    ];
    for &(name, value, expect) in cases {
        let mut pairs: Vec<_> = FULL.iter().copied().filter(|(k, _)| *k != name).collect();
        pairs.push((name, value));
        let why = invalid_argument_why(EpEnv::parse(env(&pairs)));
        assert!(why.contains(name) && why.contains(expect), "{name}={value}: {why}");
    }
}

// ---------------------------------------------------------------- the library

/// Without libnccl every entry point that would load it returns `Error::Nccl` saying so,
/// instead of cudarc's panic; with it, the version is sane and an id can be made.
#[test]
fn missing_libnccl_is_a_typed_error_host() {
    match nccl_version() {
        Err(Error::Nccl { why, .. }) => {
            assert!(why.contains("libnccl"), "{why}");
            let why = nccl_why(EpGroupId::new());
            assert!(why.contains("libnccl"), "{why}");
            println!("libnccl absent here: the missing-library path ran ({why})");
        }
        Err(other) => panic!("expected Error::Nccl, got {other:?}"),
        Ok(version) => {
            assert!(version >= 20000, "NCCL version code {version}");
            println!("libnccl {version} found: the missing-library path is not exercised in this process");
            // ncclGetUniqueId needs no GPU, only a network interface for the bootstrap.
            let (a, b) = (EpGroupId::new().unwrap(), EpGroupId::new().unwrap());
            assert_ne!(a, b, "two fresh NCCL ids are equal");
            assert_eq!(EpGroupId::from_hex(&a.to_hex()).unwrap(), a);
        }
    }
}
