//! The device flag words of a replay, read back into one typed report.
//!
//! A graph replay cannot tell the host that routes were dropped or an expert id was out of
//! range: the kernels set sticky bits in device words instead (routing: `capturable_moe/
//! routing.h`, grouped GEMM: `grouped_gemm.h`, Echo: `echo.h`). [`FlagReport::read`] reads
//! them after a replay (a host sync, so never while the stream captures) and names every bit.
//! The words stay set: clear them (`memset_zeros`) before the next replay to see only its bits.

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView};

use super::ensure_not_capturing;
use crate::echo::DeviceErrors;
use crate::moe::{MoeElement, MoeExperts};
use crate::{grouped_gemm as gg, routing, sys, Result};

/// Which word a bit was found in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlagSource {
    Routing,
    GroupedGemm,
    Echo,
    /// An EP layer's word (`capturable_moe/ep.h`, [`crate::ep::flags`]).
    Ep,
}

/// One named bit of a flag word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Flag {
    pub source: FlagSource,
    pub bit: u32,
    /// The C ABI's name of the bit, e.g. `CAPMOE_ROUTING_CAPACITY`.
    pub name: &'static str,
    /// What it means, in words.
    pub meaning: &'static str,
}

const ROUTING_BITS: [(i32, &str, &str); 4] = [
    (routing::flags::CAPACITY, "CAPMOE_ROUTING_CAPACITY", "routes were dropped by capacity / expert_capacity"),
    (routing::flags::BAD_EXPERT, "CAPMOE_ROUTING_BAD_EXPERT", "an expert id outside [0, E) was dropped"),
    (routing::flags::TOO_MANY, "CAPMOE_ROUTING_TOO_MANY", "a token of the routing map had more than k routes"),
    (
        routing::flags::BAD_TOKENS,
        "CAPMOE_ROUTING_BAD_TOKENS",
        "the device token count was outside [0, T_max] (clamped)",
    ),
];

const GEMM_BITS: [(i32, &str, &str); 4] = [
    (gg::OVERFLOW_CAPACITY, "CAPMOE_OVERFLOW_CAPACITY", "the row total exceeded the GEMM's capacity (clamped)"),
    (gg::OVERFLOW_NEGATIVE, "CAPMOE_OVERFLOW_NEGATIVE", "a negative m_splits count was read as 0"),
    (
        gg::OVERFLOW_MISALIGNED_POINTER,
        "CAPMOE_OVERFLOW_MISALIGNED",
        "a per-expert pointer was not 16-byte aligned (expert skipped)",
    ),
    (gg::OVERFLOW_NULL_POINTER, "CAPMOE_OVERFLOW_NULL_POINTER", "a per-expert pointer was null (expert skipped)"),
];

const ECHO_BITS: [(u32, &str, &str); 8] = [
    (DeviceErrors::NEGATIVE_COUNT, "CAPMOE_ECHO_ERR_NEGATIVE_COUNT", "a count was negative: the plan was zeroed"),
    (
        DeviceErrors::COUNT_TOO_LARGE,
        "CAPMOE_ECHO_ERR_COUNT_TOO_LARGE",
        "an expert count reached 2^24: the plan was zeroed",
    ),
    (
        DeviceErrors::ROUTING_MISMATCH,
        "CAPMOE_ECHO_ERR_ROUTING_MISMATCH",
        "the routing's column sums differ from the rank's counts",
    ),
    (
        DeviceErrors::EXPERT_OUT_OF_RANGE,
        "CAPMOE_ECHO_ERR_EXPERT_OUT_OF_RANGE",
        "an expert id outside [0, E) (route got -1)",
    ),
    (DeviceErrors::DUPLICATE_ROUTE, "CAPMOE_ECHO_ERR_DUPLICATE_ROUTE", "a token listed one expert twice"),
    (DeviceErrors::INTERNAL, "CAPMOE_ECHO_ERR_INTERNAL", "a planner invariant failed"),
    (
        DeviceErrors::BAD_SLOT_EXPERT,
        "CAPMOE_ECHO_ERR_BAD_SLOT_EXPERT",
        "a spare slot's expert was outside [-1, E) (slot skipped)",
    ),
    (
        DeviceErrors::BAD_TOKENS,
        "CAPMOE_ECHO_ERR_BAD_TOKENS",
        "the device token count was outside [0, num_tokens] (clamped)",
    ),
];

const EP_BITS: [(u32, &str, &str); 5] = [
    (sys::CAPMOE_EP_OVERFLOW, "CAPMOE_EP_OVERFLOW", "a peer block was full: routes dropped (counted per peer)"),
    (sys::CAPMOE_EP_BAD_DEST, "CAPMOE_EP_BAD_DEST", "a route's final column was outside the group's columns (dropped)"),
    (sys::CAPMOE_EP_BAD_TOKENS, "CAPMOE_EP_BAD_TOKENS", "the device token count was outside [0, T_max] (clamped)"),
    (sys::CAPMOE_EP_BAD_EXPERT, "CAPMOE_EP_BAD_EXPERT", "an expert id outside [-1, E) was not counted"),
    (
        sys::CAPMOE_EP_BAD_SLOT_EXPERT,
        "CAPMOE_EP_BAD_SLOT_EXPERT",
        "a spare slot's expert was outside [-1, E) (skipped)",
    ),
];

/// The words to read; any may be absent. Views of one element (e.g. `moe.maps.flags.as_view()`,
/// or an Echo plan state's error word `state.slice(layout.error..layout.error + 1)`).
#[derive(Default)]
pub struct FlagWords<'a> {
    pub routing: Option<CudaView<'a, i32>>,
    pub grouped_gemm: Option<CudaView<'a, i32>>,
    pub echo: Option<CudaView<'a, i64>>,
    pub ep: Option<CudaView<'a, i32>>,
}

/// The flag words as read, each decoded ([`FlagReport::flags`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlagReport {
    /// Routing word (`None`: not read).
    pub routing: Option<i32>,
    /// Grouped GEMM overflow word.
    pub grouped_gemm: Option<i32>,
    /// Echo error word.
    pub echo: Option<i64>,
    /// EP layer word.
    pub ep: Option<i32>,
}

impl FlagReport {
    /// Reads every given word on `stream` (synchronising it; [`crate::Error::Capturing`] while
    /// it captures).
    pub fn read(stream: &Arc<CudaStream>, words: FlagWords<'_>) -> Result<FlagReport> {
        ensure_not_capturing(stream, "FlagReport::read")?;
        let first = |v: Vec<i32>| v.first().copied();
        Ok(FlagReport {
            routing: match &words.routing {
                Some(w) => first(stream.clone_dtoh(w)?),
                None => None,
            },
            grouped_gemm: match &words.grouped_gemm {
                Some(w) => first(stream.clone_dtoh(w)?),
                None => None,
            },
            echo: match &words.echo {
                Some(w) => stream.clone_dtoh(w)?.first().copied(),
                None => None,
            },
            ep: match &words.ep {
                Some(w) => first(stream.clone_dtoh(w)?),
                None => None,
            },
        })
    }

    /// The routing and grouped GEMM words of an expert path, on its stream.
    pub fn of_moe<T: MoeElement>(moe: &MoeExperts<T>) -> Result<FlagReport> {
        let words = FlagWords {
            routing: Some(moe.maps.flags.as_view()),
            grouped_gemm: Some(moe.gemm_flags.as_view()),
            ..Default::default()
        };
        Self::read(moe.stream(), words)
    }

    /// Every bit set, named; bits no header defines come out as `UNKNOWN`.
    pub fn flags(&self) -> Vec<Flag> {
        let mut out = Vec::new();
        if let Some(word) = self.routing {
            decode(
                &mut out,
                FlagSource::Routing,
                word as u32,
                ROUTING_BITS.map(|(b, n, m)| (b as u32, n, m)).as_slice(),
            );
        }
        if let Some(word) = self.grouped_gemm {
            decode(
                &mut out,
                FlagSource::GroupedGemm,
                word as u32,
                GEMM_BITS.map(|(b, n, m)| (b as u32, n, m)).as_slice(),
            );
        }
        if let Some(word) = self.echo {
            decode(&mut out, FlagSource::Echo, word as u32, &ECHO_BITS);
            if (word as u64) >> 32 != 0 {
                out.push(Flag { source: FlagSource::Echo, bit: 0, name: "UNKNOWN", meaning: "bits above 31 are set" });
            }
        }
        if let Some(word) = self.ep {
            decode(&mut out, FlagSource::Ep, word as u32, &EP_BITS);
        }
        out
    }

    /// No bit set in any word read.
    pub fn is_clean(&self) -> bool {
        self.routing.unwrap_or(0) == 0
            && self.grouped_gemm.unwrap_or(0) == 0
            && self.echo.unwrap_or(0) == 0
            && self.ep.unwrap_or(0) == 0
    }

    /// Whether `source`'s word has the bit with the C ABI name `name`.
    pub fn has(&self, source: FlagSource, name: &str) -> bool {
        self.flags().iter().any(|f| f.source == source && f.name == name)
    }
}

impl std::fmt::Display for FlagReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let flags = self.flags();
        if flags.is_empty() {
            return write!(f, "no flags set");
        }
        let parts: Vec<String> = flags.iter().map(|x| format!("{:?}: {} ({})", x.source, x.name, x.meaning)).collect();
        write!(f, "{}", parts.join("; "))
    }
}

fn decode(out: &mut Vec<Flag>, source: FlagSource, word: u32, known: &[(u32, &'static str, &'static str)]) {
    let mut rest = word;
    for &(bit, name, meaning) in known {
        if word & bit != 0 {
            out.push(Flag { source, bit, name, meaning });
            rest &= !bit;
        }
    }
    for i in 0..32 {
        if rest & (1 << i) != 0 {
            out.push(Flag { source, bit: 1 << i, name: "UNKNOWN", meaning: "a bit no header of this build defines" });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bit a header defines decodes to its own name, once, from its own word.
    #[test]
    fn every_defined_bit_decodes_to_its_name_host() {
        for (bit, name, _) in ROUTING_BITS {
            let r = FlagReport { routing: Some(bit), ..Default::default() };
            assert_eq!(r.flags().iter().map(|f| f.name).collect::<Vec<_>>(), vec![name]);
            assert!(r.has(FlagSource::Routing, name) && !r.has(FlagSource::GroupedGemm, name));
        }
        for (bit, name, _) in GEMM_BITS {
            let r = FlagReport { grouped_gemm: Some(bit), ..Default::default() };
            assert_eq!(r.flags().iter().map(|f| f.name).collect::<Vec<_>>(), vec![name]);
        }
        for (bit, name, _) in ECHO_BITS {
            let r = FlagReport { echo: Some(bit as i64), ..Default::default() };
            assert_eq!(r.flags().iter().map(|f| f.name).collect::<Vec<_>>(), vec![name]);
        }
        for (bit, name, _) in EP_BITS {
            let r = FlagReport { ep: Some(bit as i32), ..Default::default() };
            assert_eq!(r.flags().iter().map(|f| f.name).collect::<Vec<_>>(), vec![name]);
            assert!(r.has(FlagSource::Ep, name) && !r.has(FlagSource::Routing, name));
        }
    }

    /// The bit values are the C headers' (read through bindgen), so they cannot drift.
    #[test]
    fn bit_values_are_the_c_headers_host() {
        use crate::sys;
        assert_eq!(
            ROUTING_BITS.map(|b| b.0 as u32),
            [
                sys::CAPMOE_ROUTING_CAPACITY,
                sys::CAPMOE_ROUTING_BAD_EXPERT,
                sys::CAPMOE_ROUTING_TOO_MANY,
                sys::CAPMOE_ROUTING_BAD_TOKENS
            ]
        );
        assert_eq!(
            GEMM_BITS.map(|b| b.0 as u32),
            [
                sys::CAPMOE_OVERFLOW_CAPACITY,
                sys::CAPMOE_OVERFLOW_NEGATIVE,
                sys::CAPMOE_OVERFLOW_MISALIGNED,
                sys::CAPMOE_OVERFLOW_NULL_POINTER
            ]
        );
        assert_eq!(ECHO_BITS.iter().fold(0, |acc, b| acc | b.0), 255, "the eight Echo bits are 1 ..= 128");
    }

    /// Several bits across words, unknown bits kept, and a clean report.
    #[test]
    fn mixed_words_and_unknown_bits_host() {
        let r = FlagReport { routing: Some(1 | 16 | 2), grouped_gemm: Some(64), echo: Some(4 | (1 << 40)), ep: None };
        let names: Vec<_> = r.flags().iter().map(|f| (f.source, f.name, f.bit)).collect();
        assert_eq!(
            names,
            vec![
                (FlagSource::Routing, "CAPMOE_ROUTING_CAPACITY", 1),
                (FlagSource::Routing, "CAPMOE_ROUTING_BAD_TOKENS", 16),
                (FlagSource::Routing, "UNKNOWN", 2),
                (FlagSource::GroupedGemm, "CAPMOE_OVERFLOW_NULL_POINTER", 64),
                (FlagSource::Echo, "CAPMOE_ECHO_ERR_ROUTING_MISMATCH", 4),
                (FlagSource::Echo, "UNKNOWN", 0),
            ]
        );
        assert!(!r.is_clean());
        let clean = FlagReport { routing: Some(0), grouped_gemm: Some(0), echo: None, ep: Some(0) };
        assert!(clean.is_clean() && clean.flags().is_empty());
        assert_eq!(clean.to_string(), "no flags set");
        assert!(r.to_string().contains("CAPMOE_OVERFLOW_NULL_POINTER"));
    }
}
