//! Configuration of one Echo planner instance and its host-side validation.

use crate::{Error, Result};

/// How spill-over is assigned to spare slots (spec P2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// One-shot greedy interval assignment (upstream `one_shot_greedy`), any `S_per`.
    Greedy,
    /// Approximate bin packing with 8 FIFO buckets (upstream `approx_bin_packing`), `S_per == 1`.
    Approx,
}

impl Algorithm {
    /// The upstream default after commit d8232ade: `Approx` for one slot per rank, else `Greedy`.
    pub fn default_for(spare_per_rank: usize) -> Algorithm {
        if spare_per_rank == 1 {
            Algorithm::Approx
        } else {
            Algorithm::Greedy
        }
    }

    /// Parses the upstream names (`one_shot_greedy`, `approx_bin_packing`) and the short ones.
    pub fn from_name(name: &str) -> Result<Algorithm> {
        match name {
            "one_shot_greedy" | "greedy" => Ok(Algorithm::Greedy),
            "approx_bin_packing" | "approx" => Ok(Algorithm::Approx),
            other => Err(Error::InvalidArgument {
                op: "echo config",
                why: format!("unknown algorithm '{other}' (one_shot_greedy or approx_bin_packing)"),
            }),
        }
    }

    pub(crate) fn abi_code(self) -> i32 {
        match self {
            Algorithm::Greedy => 0,
            Algorithm::Approx => 1,
        }
    }
}

/// The static shape of one planner: identical on every EP rank except `ep_rank`.
#[derive(Clone, Debug, PartialEq)]
pub struct EchoConfig {
    /// EP ranks, `>= 1`.
    pub ep: usize,
    /// Home experts `E`, a multiple of `ep`.
    pub num_experts: usize,
    /// Spare slots per rank `S_per`, `>= 1`.
    pub spare_per_rank: usize,
    /// This rank, `< ep`.
    pub ep_rank: usize,
    /// Routes per token `k` (top-k form only; `>= 1`).
    pub topk: usize,
    pub algorithm: Algorithm,
    /// Reclaim threshold multiplier (P3); used by `Greedy` only, and only when `> 0`.
    pub threshold_multiplier: f32,
}

/// Largest `E` the GPU planner supports (one thread per expert in one block).
pub const MAX_EXPERTS: usize = 1024;
/// Largest `S = EP * S_per` the GPU planner supports (one thread per slot in one block).
pub const MAX_SPARE: usize = 1024;

impl EchoConfig {
    /// `L = E / EP`.
    pub fn local_experts(&self) -> usize {
        self.num_experts / self.ep
    }

    /// `S = EP * S_per`.
    pub fn num_spare(&self) -> usize {
        self.ep * self.spare_per_rank
    }

    /// `E + S`, the width of the rerouted map.
    pub fn num_columns(&self) -> usize {
        self.num_experts + self.num_spare()
    }

    /// Final (interleaved, spec P9) column of home expert `e`.
    pub fn expert_column(&self, e: usize) -> usize {
        let l = self.local_experts();
        (e / l) * (l + self.spare_per_rank) + e % l
    }

    /// Final (interleaved, spec P9) column of spare slot `j`.
    pub fn slot_column(&self, j: usize) -> usize {
        let (l, sp) = (self.local_experts(), self.spare_per_rank);
        (j / sp) * (l + sp) + l + j % sp
    }

    /// The spec's preconditions (section 3) that depend on the configuration alone, plus the
    /// GPU planner's size limits. The CPU reference has no size limits beyond the spec's.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "echo config";
        let bad = |why: String| Err(Error::InvalidArgument { op: OP, why });
        if self.ep == 0 {
            return bad("ep must be >= 1".into());
        }
        if self.num_experts == 0 || !self.num_experts.is_multiple_of(self.ep) {
            return bad(format!("num_experts = {} must be a positive multiple of ep = {}", self.num_experts, self.ep));
        }
        if self.spare_per_rank == 0 || self.spare_per_rank > self.num_experts {
            return bad(format!(
                "spare_per_rank = {} must be in [1, num_experts = {}]",
                self.spare_per_rank, self.num_experts
            ));
        }
        if self.algorithm == Algorithm::Approx && self.spare_per_rank != 1 {
            return bad(format!(
                "approx_bin_packing requires spare_per_rank == 1, got {} (use one_shot_greedy)",
                self.spare_per_rank
            ));
        }
        if self.ep_rank >= self.ep {
            return bad(format!("ep_rank = {} must be < ep = {}", self.ep_rank, self.ep));
        }
        if self.topk == 0 || self.topk > self.num_experts {
            return bad(format!("topk = {} must be in [1, num_experts = {}]", self.topk, self.num_experts));
        }
        if !self.threshold_multiplier.is_finite() {
            return bad(format!("threshold_multiplier = {} must be finite", self.threshold_multiplier));
        }
        Ok(())
    }

    /// [`validate`](Self::validate) plus the GPU kernels' limits (`E <= 1024`, `S <= 1024`).
    pub fn validate_gpu(&self) -> Result<()> {
        self.validate()?;
        if self.num_experts > MAX_EXPERTS || self.num_spare() > MAX_SPARE {
            return Err(Error::Unsupported {
                op: "echo plan",
                why: format!(
                    "the GPU planner handles num_experts <= {MAX_EXPERTS} and ep * spare_per_rank <= \
                     {MAX_SPARE}; got {} and {}",
                    self.num_experts,
                    self.num_spare()
                ),
            });
        }
        Ok(())
    }
}
