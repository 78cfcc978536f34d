//! The kernel plan: everything a backend needs to emit one attention kernel, decided once per
//! spec and independent of sequence lengths and batch size (they are runtime arguments, so a
//! new shape never recompiles).
//!
//! Planning is a short pipeline of passes, each printable:
//! 1. `ScoreProgram::of`: the spec's built-ins and custom modifiers as modifier IR;
//! 2. `ScoreProgram::folded`: constant folding and simplification;
//! 3. [`KernelPlan::forward`]: the kernel's shape (MLA absorbed into one shared KV head), tiles,
//!    the fused RoPE prologue, the tile-masking strategy and the online-softmax epilogue.

use crate::hoist::hoist_score_factor;
use attn_dsl::modifier::fold::fold;
use attn_dsl::modifier::grad::{GradError, derivative};
use attn_dsl::modifier::interval::{Interval, TensorRanges, TileBounds, TileClass, classify_with};
use attn_dsl::modifier::scale::scale;
use attn_dsl::modifier::{BinOp, Expr, ParamRead, ScoreProgram, Var};
use attn_dsl::reference::rope;
use attn_dsl::{AttentionSpec, DType, KvLayout, Normalize, Rope, RopeScaling};
use std::fmt;

pub use crate::param_layout::{DataRanges, DataSlot, ParamLayout, ParamSlot};

/// Which kernel a plan is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlanKind {
    /// Prefill / training forward: a block of query rows of one head against all keys (packed
    /// into tiles per call), out and lse.
    Forward,
    /// Decoding against a KV cache: the query rows of a kv head's group of query heads (a few
    /// queries each) against key segments read in place (cache pages, no gather), keys stored
    /// rotated; out and lse per partition of the keys, merged by their lse (split-KV).
    Decode,
    /// Training backward (FlashAttention-2 recomputation): for each key tile of a kv head, every
    /// query block of its group recomputes the probabilities from the saved lse, then
    /// `dS = P (dP - D) * d score / d raw`; dq, dk, dv accumulate from tile products.
    Backward,
}

/// The head geometry as the kernel sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelShape {
    /// Query heads.
    pub heads: u32,
    /// Key/value heads the kernel reads (1 for MLA: the latent is shared).
    pub kv_heads: u32,
    /// Width of q and k rows (MLA: `latent_rank + rope_dim`).
    pub qk_dim: u32,
    /// Width of v rows and of the output (MLA: `latent_rank`; the up-projection follows).
    pub v_dim: u32,
}

impl KernelShape {
    /// Query heads per KV head.
    pub fn group(&self) -> u32 {
        self.heads / self.kv_heads
    }
}

/// MLA's absorbed form around the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaAbsorption {
    /// Latent rank `r`: `q_latent = W_uk^T q_nope` before the kernel, `out = W_uv out_latent`
    /// after it.
    pub latent_rank: u32,
    /// Rotary dim `dr`: `q = [q_latent | q_pe]`, `k = [c_kv | k_pe]`.
    pub rope_dim: u32,
    /// Per-head output dim after the up-projection.
    pub v_head_dim: u32,
}

/// Tile sizes: query rows per block and keys per streamed K/V tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiles {
    /// Query rows a kernel invocation owns.
    pub q_rows: u32,
    /// Keys per K/V tile.
    pub k_cols: u32,
}

/// Where the RoPE frequencies come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Frequencies {
    /// Fixed for the spec: computed at plan time in f64.
    Static(Vec<f64>),
    /// Dynamic NTK and LongRoPE: the frequencies depend on the total length `Skv + p0`,
    /// computed per launch.
    PerLaunch,
}

/// RoPE fused into the loads of q and k tiles.
#[derive(Clone, Debug, PartialEq)]
pub struct RopePrologue {
    /// The spec's RoPE parameters.
    pub rope: Rope,
    /// First rotated dimension within a q/k row (MLA: after the latent).
    pub first_dim: u32,
    /// The inverse frequencies.
    pub frequencies: Frequencies,
    /// Factor on cos and sin (YaRN's attention factor; 1 otherwise).
    pub attention_factor: f64,
}

impl RopePrologue {
    /// The RoPE of a spec's q and k rows (MLA: on the dims after the latent), if it has one.
    pub fn of(spec: &AttentionSpec) -> Option<RopePrologue> {
        spec.rope().map(|r| RopePrologue {
            rope: r.clone(),
            first_dim: spec.mla().map_or(0, |m| m.latent_rank),
            frequencies: match r.scaling {
                RopeScaling::Dynamic { .. } | RopeScaling::LongRope(_) => Frequencies::PerLaunch,
                _ => Frequencies::Static(rope::inv_freq(r, 0)),
            },
            attention_factor: rope::attention_factor(r),
        })
    }
}

/// How tiles meet the mask.
#[derive(Clone, Debug, PartialEq)]
pub enum TileMasking {
    /// The mask is `true`: no tile is skipped and no element masked.
    Unmasked,
    /// Each (query block, key tile) is classified by interval analysis of the mask over the
    /// tile's positions: all-masked tiles are skipped, all-kept tiles run without per-element
    /// masking, mixed tiles evaluate the mask per element.
    Classified {
        /// The variables the mask reads (the ranges a kernel supplies).
        reads: Vec<Var>,
    },
}

/// What the kernel writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Epilogue {
    /// Dtype of `out` (the input dtype).
    pub out_dtype: DType,
}

/// A planned attention kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelPlan {
    /// The kernel kind.
    pub kind: PlanKind,
    /// The spec planned from.
    pub spec: AttentionSpec,
    /// Storage dtype of q, k, v and out (accumulation is f32).
    pub dtype: DType,
    /// Head geometry.
    pub shape: KernelShape,
    /// MLA's absorption around the kernel, for MLA specs.
    pub mla: Option<MlaAbsorption>,
    /// Tile sizes.
    pub tiles: Tiles,
    /// RoPE on q and k as tiles are loaded.
    pub rope: Option<RopePrologue>,
    /// Score pipeline and mask, folded. The score is in half base-2 units (the spec's score
    /// times `log2(e) / 2`, for a softmax of `2^(2 (s - m))`): every finite f32 score stays
    /// finite once scaled, where base 2 alone overflows past `f32::MAX / log2 e` (about 2.36e38).
    /// A constant factor on the raw score is moved into `q_scale`.
    pub program: ScoreProgram,
    /// Factor the queries are multiplied by as they load (the score scale times `log2(e) / 2`,
    /// when the program applies it to the raw score; else 1).
    pub q_scale: f64,
    /// Tile skipping and unmasking.
    pub masking: TileMasking,
    /// Backward plans: `d score / d raw score` in natural units, as a program over the raw
    /// score the kernel sees (q already scaled by `q_scale`): [`ScoreProgram::score_gradient`]
    /// of `program.score`, times `2 ln 2` (the program is in half base-2 units). `None` for
    /// forward and decode plans.
    pub score_grad: Option<Expr>,
    /// Backward plans: for each distinct parameter read of the score, `d score / d read` in
    /// natural units, over the raw score the kernel sees ([`ScoreProgram::param_gradients`]
    /// of `program.score`, times `2 ln 2`). Empty for forward and decode plans.
    pub param_grads: Vec<(ParamRead, Expr)>,
    /// Where each parameter lies in the one 32-bit buffer kernels read them from, and where a
    /// call puts its data tensors.
    pub params: ParamLayout,
    /// Output.
    pub epilogue: Epilogue,
}

impl KernelPlan {
    /// Plans the forward kernel of a spec. The spec must be valid.
    pub fn forward(spec: &AttentionSpec) -> KernelPlan {
        let (shape, mla) = match spec.kv {
            KvLayout::Heads { kv_heads } => (
                KernelShape {
                    heads: spec.heads,
                    kv_heads,
                    qk_dim: spec.head_dim,
                    v_dim: spec.v_head_dim,
                },
                None,
            ),
            KvLayout::Mla(m) => (
                KernelShape {
                    heads: spec.heads,
                    kv_heads: 1,
                    qk_dim: m.latent_rank + m.rope_dim,
                    v_dim: m.latent_rank,
                },
                Some(MlaAbsorption {
                    latent_rank: m.latent_rank,
                    rope_dim: m.rope_dim,
                    v_head_dim: spec.v_head_dim,
                }),
            ),
        };
        let rope = RopePrologue::of(spec);
        let mut program = ScoreProgram::of(spec).folded();
        if let Normalize::Sigmoid(bias) = spec.normalize {
            // Sigmoid attention weighs `sigmoid(s + B)`: the bias joins the program, so the
            // kernels' weight of a score `t` is `1 / (1 + 2^(-2t))`.
            program.score = fold(&Expr::binary(
                BinOp::Add,
                program.score,
                Expr::Float(bias.value()),
            ));
        }
        // Half base-2 units: scores times log2(e) / 2, probabilities 2^(2 (s - m)).
        program.score = fold(&scale(&program.score, std::f64::consts::LOG2_E / 2.0));
        let mut q_scale = 1.0;
        while let Some((score, factor)) = hoist_score_factor(&program.score) {
            // Only factors that shrink q: a larger one (a modifier's `s * 3.4e38`) could make a
            // query element overflow f32 before any score does, and its row NaN.
            if (q_scale * factor).abs() > 1.0 {
                break;
            }
            program.score = score;
            q_scale *= factor;
        }
        let masking = match program.mask {
            Expr::Bool(true) => TileMasking::Unmasked,
            ref mask => TileMasking::Classified {
                reads: Var::ALL.into_iter().filter(|v| mask.uses(*v)).collect(),
            },
        };
        KernelPlan {
            kind: PlanKind::Forward,
            spec: spec.clone(),
            dtype: spec.dtype,
            shape,
            mla,
            tiles: tiles_for(shape.qk_dim.max(shape.v_dim)),
            rope,
            program,
            q_scale,
            masking,
            score_grad: None,
            param_grads: Vec::new(),
            params: ParamLayout::of(spec),
            epilogue: Epilogue {
                out_dtype: spec.dtype,
            },
        }
    }

    /// Plans the decode kernel of a spec: the forward plan's program, masking and RoPE (on the
    /// queries; a cache stores keys rotated), with rows of [`DECODE_ROWS`] (query heads x
    /// queries) and keys in segments of at most [`K_TILE`]. The spec must be valid.
    pub fn decode(spec: &AttentionSpec) -> KernelPlan {
        KernelPlan {
            kind: PlanKind::Decode,
            tiles: Tiles {
                q_rows: DECODE_ROWS,
                k_cols: K_TILE,
            },
            ..KernelPlan::forward(spec)
        }
    }

    /// Plans the backward kernel of a spec: the forward plan's program, masking and RoPE, query
    /// blocks of [`BACKWARD_ROWS`] rows (a block's probabilities, transposed, are rows of one key
    /// tile's width), and the derivative of the score program. The spec must be valid; the error
    /// says when the derivative is too large to build.
    pub fn backward(spec: &AttentionSpec) -> Result<KernelPlan, GradError> {
        let forward = KernelPlan::forward(spec);
        let gradient = derivative(&forward.program.score)?;
        let natural = fold(&scale(&gradient.expr, 2.0 * std::f64::consts::LN_2));
        let param_grads = forward
            .program
            .param_gradients()?
            .into_iter()
            .map(|(read, d)| (read, fold(&scale(&d, 2.0 * std::f64::consts::LN_2))))
            .collect();
        Ok(KernelPlan {
            kind: PlanKind::Backward,
            tiles: Tiles {
                q_rows: BACKWARD_ROWS,
                k_cols: K_TILE,
            },
            score_grad: Some(natural),
            param_grads,
            ..forward
        })
    }

    /// Whether the spec weighs keys by `normalize = sigmoid(..)` (no running max, no division
    /// by the row's sum; the bias is in `program.score`).
    pub fn sigmoid(&self) -> bool {
        matches!(self.spec.normalize, Normalize::Sigmoid(_))
    }

    /// Whether the spec weighs keys by `normalize = stick_breaking` (keys from the nearest:
    /// tiles in descending order, the row's running sum of `softplus` kept where softmax keeps
    /// its max).
    pub fn stick_breaking(&self) -> bool {
        self.spec.normalize == Normalize::StickBreaking
    }

    /// Whether the weights are not divided by their row's sum (sigmoid, stick-breaking): out
    /// is the weighted sum as it stands, `lse = ln l`, and split rows merge by adding.
    pub fn unnormalized(&self) -> bool {
        self.spec.normalize != Normalize::Softmax
    }

    /// The ranges of the data tensors the mask reads, from a call's checked parameter buffer,
    /// for [`CallShape::data`]; `None` when the mask reads none.
    pub fn mask_data_ranges(&self, buffer: &[f32]) -> Option<DataRanges> {
        let reads = self.program.mask.param_reads();
        let names: Vec<&str> = reads
            .iter()
            .map(|r| r.name.as_str())
            .filter(|n| self.params.data_slot(n).is_some())
            .collect();
        (!names.is_empty()).then(|| DataRanges::of(&self.params, buffer, &names))
    }

    /// How the tile of query rows `rows` and keys `keys` (inclusive index ranges) of a call with
    /// `sq` queries against `skv` keys at offset `p0` meets the mask, for the given batch and head
    /// ranges. Kernels skip `AllMasked` tiles and drop the mask on `AllKept` ones.
    pub fn classify_tile(&self, rows: Interval, keys: Interval, call: CallShape<'_>) -> TileClass {
        match &self.masking {
            TileMasking::Unmasked => TileClass::AllKept,
            TileMasking::Classified { .. } => {
                let mut bounds = TileBounds::for_tile(rows, keys, call.sq, call.skv, call.p0);
                let q = bounds.query;
                bounds.query = Interval::new(
                    q.lo.saturating_add(call.query_shift),
                    q.hi.saturating_add(call.query_shift),
                );
                bounds.batch = call.batch;
                bounds.head = call.head;
                let data = call.data.map(|d| d as &dyn TensorRanges);
                classify_with(&self.program.mask, &bounds, data)
            }
        }
    }

    /// The code a kernel reads for the tile of query rows `rows` and keys `keys` (see
    /// [`KernelPlan::classify_tile`]): the one classification every backend's launch uses.
    /// `complete` says whether the tile holds the kernel's full tile width of keys: kernels that
    /// bound keys only on masked tiles get `Masked` for an incomplete tile whose keys are all kept.
    pub fn tile_code(
        &self,
        rows: Interval,
        keys: Interval,
        call: CallShape<'_>,
        complete: bool,
    ) -> TileCode {
        match self.classify_tile(rows, keys, call) {
            TileClass::AllMasked => TileCode::Skip,
            TileClass::AllKept if complete => TileCode::Full,
            TileClass::AllKept | TileClass::Mixed => TileCode::Masked,
        }
    }

    /// The rows of a mixed tile that can keep a key: `rows` narrowed from both ends by groups of
    /// [`ROW_GROUP`] rows the classification proves all masked. Rows outside the result leave
    /// the running softmax state unchanged, so a kernel skips them (on the diagonal of a causal
    /// mask, half of the last key tile's rows). `None` when every row is masked.
    pub fn live_rows(
        &self,
        rows: Interval,
        keys: Interval,
        call: CallShape<'_>,
    ) -> Option<Interval> {
        let group = ROW_GROUP as i64;
        let masked = |lo: i64, hi: i64| {
            self.classify_tile(Interval::new(lo, hi), keys, call) == TileClass::AllMasked
        };
        let mut lo = rows.lo;
        while lo <= rows.hi && masked(lo, (lo + group - 1).min(rows.hi)) {
            lo += group;
        }
        if lo > rows.hi {
            return None;
        }
        // Groups counted from `lo`, so the upper end stays aligned with the lower one.
        let mut hi = rows.hi;
        loop {
            let group_lo = lo + (hi - lo) / group * group;
            if group_lo == lo || !masked(group_lo, hi) {
                break;
            }
            hi = group_lo - 1;
        }
        Some(Interval::new(lo, hi))
    }

    /// The first row of a mixed tile's live `rows` from which the classification proves every
    /// key kept, by groups of [`ROW_GROUP`] rows counted from `rows.lo` (`rows.hi + 1` when no
    /// group is): a kernel runs those rows without the mask (on a causal diagonal, the rows of
    /// a tall query block that lie below the tile's keys). A binary search over the groups,
    /// sound for any mask: rows from a group on are all kept if the rows from an earlier group
    /// on are.
    pub fn kept_from(&self, rows: Interval, keys: Interval, call: CallShape<'_>) -> i64 {
        let group = i64::from(ROW_GROUP);
        let groups = (rows.hi - rows.lo) / group + 1;
        let kept_from_group = |g: i64| {
            let from = Interval::new(rows.lo + g * group, rows.hi);
            self.classify_tile(from, keys, call) == TileClass::AllKept
        };
        if !kept_from_group(groups - 1) {
            return rows.hi + 1;
        }
        let (mut lo, mut hi) = (0, groups - 1);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if kept_from_group(mid) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        rows.lo + lo * group
    }

    /// The classification of every (query block, key tile) of a call with `sq` queries against
    /// `skv` keys at offset `p0`, for all batches and heads at once (a kernel classifies per
    /// head, which can only be finer).
    pub fn tile_map(&self, sq: u64, skv: u64, p0: i64) -> TileMap {
        self.tile_map_of(CallShape {
            sq: sq as i64,
            skv: skv as i64,
            p0,
            query_shift: 0,
            batch: Interval::new(0, i64::MAX),
            head: Interval::new(0, i64::from(self.shape.heads) - 1),
            data: None,
        })
    }

    /// [`KernelPlan::tile_map`] of a call as `call` gives it: its batch items and heads, and
    /// the ranges of the data its mask reads.
    pub fn tile_map_of(&self, call: CallShape<'_>) -> TileMap {
        let (rows, cols) = (i64::from(self.tiles.q_rows), i64::from(self.tiles.k_cols));
        let blocks = |n: i64, size: i64| {
            (0..(n + size - 1) / size)
                .map(move |t| Interval::new(t * size, ((t + 1) * size).min(n) - 1))
        };
        let classes = blocks(call.sq, rows)
            .map(|q| {
                blocks(call.skv, cols)
                    .map(|k| self.classify_tile(q, k, call))
                    .collect()
            })
            .collect();
        TileMap { classes }
    }
}

/// The runtime shape of a call, as tile classification needs it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CallShape<'a> {
    /// Queries.
    pub sq: i64,
    /// Keys.
    pub skv: i64,
    /// Position of key 0.
    pub p0: i64,
    /// How far the queries lie past bottom-right alignment (`attn_runtime::placement`): 0 but
    /// for a piece of a context-parallel call.
    pub query_shift: i64,
    /// Batch indices the classification must hold for.
    pub batch: Interval,
    /// Heads the classification must hold for.
    pub head: Interval,
    /// The ranges of the data tensors the mask reads (`None`: any value; a mask that reads
    /// none needs none).
    pub data: Option<&'a DataRanges>,
}

/// How a block of query rows meets a tile of keys, in the one encoding every kernel reads
/// (CPU segments and block tiles, GPU tile codes).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileCode {
    /// Every pair masked: the tile is skipped.
    Skip = 0,
    /// Every pair kept: no per-element mask (and, for kernels that bound keys only on masked
    /// tiles, the tile holds a full tile width of keys).
    Full = 1,
    /// The mask (and the key bound) apply per element.
    Masked = 2,
}

/// Key tiles are always [`K_TILE`] keys (the CPU microkernels are specialized for it); query
/// blocks of 256 rows up to width 128 (each K and V tile streamed from L3 then serves 256 rows),
/// shrinking as rows widen so a block's q, scores and accumulator stay near 320 KiB of f32.
fn tiles_for(width: u32) -> Tiles {
    let q_rows = match width {
        0..=128 => 256,
        129..=256 => 128,
        _ => 32,
    };
    Tiles {
        q_rows,
        k_cols: K_TILE,
    }
}

/// Keys per K/V tile.
pub const K_TILE: u32 = 64;

/// Rows the forward kernels narrow a mixed tile's row range by ([`KernelPlan::live_rows`]).
pub const ROW_GROUP: u32 = 8;

/// Query rows per block of the backward kernel: at most [`K_TILE`], so a block's
/// probabilities transposed are rows of one key tile's width.
pub const BACKWARD_ROWS: u32 = 64;

/// Rows (query heads of one kv head x queries) of a decode block.
pub const DECODE_ROWS: u32 = 64;

/// Tile classes of one call: rows are query blocks, columns key tiles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TileMap {
    /// `classes[query block][key tile]`.
    pub classes: Vec<Vec<TileClass>>,
}

impl TileMap {
    /// How many tiles have the class.
    pub fn count(&self, class: TileClass) -> usize {
        self.classes
            .iter()
            .flatten()
            .filter(|c| **c == class)
            .count()
    }
}

impl fmt::Display for TileMap {
    /// One character per tile: `#` all kept, `.` all masked (skipped), `/` mixed.
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        for row in &self.classes {
            let line: String = row
                .iter()
                .map(|c| match c {
                    TileClass::AllKept => '#',
                    TileClass::AllMasked => '.',
                    TileClass::Mixed => '/',
                })
                .collect();
            writeln!(f, "{line}")?;
        }
        Ok(())
    }
}

impl fmt::Display for KernelPlan {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let s = &self.shape;
        writeln!(f, "plan {:?}", self.kind)?;
        writeln!(f, "  spec      {}", self.spec)?;
        writeln!(
            f,
            "  shape     {} query heads over {} kv heads (group {}), qk_dim {}, v_dim {}, {} \
             storage, f32 accumulation",
            s.heads,
            s.kv_heads,
            s.group(),
            s.qk_dim,
            s.v_dim,
            self.dtype.name()
        )?;
        if let Some(m) = &self.mla {
            writeln!(
                f,
                "  mla       absorbed: q = [W_uk^T q_nope ({}) | q_pe ({})], k = [c_kv | k_pe], \
                 v = c_kv; out = W_uv out_latent ({} per head)",
                m.latent_rank, m.rope_dim, m.v_head_dim
            )?;
        }
        writeln!(
            f,
            "  tiles     {} query rows x {} keys",
            self.tiles.q_rows, self.tiles.k_cols
        )?;
        if self.kind == PlanKind::Decode {
            writeln!(
                f,
                "  decode    rows are query heads of one kv head x queries; keys read in place \
                 from cache segments (stored rotated); split-KV partitions merged by lse"
            )?;
        }
        if self.q_scale != 1.0 {
            writeln!(
                f,
                "  prologue  q x {:?} as rows load (the score scale x log2(e) / 2, hoisted)",
                self.q_scale
            )?;
        }
        match &self.rope {
            None => writeln!(f, "  prologue  load q, k tiles")?,
            Some(r) => {
                let freqs = match &r.frequencies {
                    Frequencies::Static(v) => format!(
                        "{} static inv_freq from {:?} to {:?}",
                        v.len(),
                        v.first().copied().unwrap_or(0.0),
                        v.last().copied().unwrap_or(0.0)
                    ),
                    Frequencies::PerLaunch => "inv_freq per launch from Skv + p0".to_string(),
                };
                writeln!(
                    f,
                    "  prologue  rope on dims {}..{} of q and k as tiles load: {}; {freqs}; \
                     cos/sin x {:?}",
                    r.first_dim,
                    r.first_dim + r.rope.dim,
                    r.rope,
                    r.attention_factor
                )?;
            }
        }
        writeln!(
            f,
            "  score     {}  (half base 2: x log2(e) / 2)",
            self.program.score
        )?;
        writeln!(f, "  mask      {}", self.program.mask)?;
        if self.sigmoid() {
            writeln!(
                f,
                "  normalize {}: p = 1 / (1 + 2^(-2 s)) per key, the bias in the score",
                self.spec.normalize.name()
            )?;
        }
        if self.stick_breaking() {
            writeln!(
                f,
                "  normalize stick_breaking: key tiles from the last, each from its last key: \
                 p = sigmoid(x) e^(-R), then R += softplus(x) (x = 2 s ln 2; R per row from 0)"
            )?;
        }
        if let Some(grad) = &self.score_grad {
            self.describe_backward(f, grad)?;
        }
        if !self.params.is_empty() {
            let slots = self
                .params
                .slots
                .iter()
                .map(|s| format!("{} {:?} at {}", s.name, s.shape, s.offset));
            let data = self.params.data.iter().map(|d| {
                format!(
                    "{} ({} {}-d, header at {})",
                    d.name,
                    d.dtype.name(),
                    d.rank,
                    d.header
                )
            });
            let all: Vec<String> = slots.chain(data).collect();
            writeln!(f, "  params    one 32-bit buffer: {}", all.join(", "))?;
        }
        match &self.masking {
            TileMasking::Unmasked => writeln!(f, "  tiling    every tile unmasked")?,
            TileMasking::Classified { reads } => {
                let names: Vec<&str> = reads.iter().map(|v| v.canonical_name()).collect();
                writeln!(
                    f,
                    "  tiling    classify each tile by intervals of ({}): skip all-masked, \
                     unmasked all-kept, per-element mask on mixed",
                    names.join(", ")
                )?;
            }
        }
        if self.kind == PlanKind::Backward {
            return write!(
                f,
                "  epilogue  dq x the hoisted q factor; dq and dk rotated back by RoPE's transpose; \
                 dq, dk, dv as {}; rows whose lse is -inf carry no gradient",
                self.epilogue.out_dtype.name()
            );
        }
        if self.unnormalized() {
            return write!(
                f,
                "  epilogue  sum of weighted values: out = acc as {}, lse = ln l (l the sum of \
                 the weights) as f32; rows with no kept key: out 0, lse -inf",
                self.epilogue.out_dtype.name()
            );
        }
        write!(
            f,
            "  epilogue  online softmax in half base 2 (p = 2^(2 (s - m)), running max m, sum l; \
             acc rescaled by 2^(2 (m_old - m_new))); out = acc / l as {}, lse = 2 m ln 2 + ln l \
             as f32; rows with no kept key: out 0, lse -inf",
            self.epilogue.out_dtype.name()
        )
    }
}

impl KernelPlan {
    /// The backward lines of the plan's printed form: what a tile recomputes and the
    /// derivatives it multiplies by.
    fn describe_backward(&self, f: &mut fmt::Formatter, grad: &Expr) -> fmt::Result {
        if self.sigmoid() {
            writeln!(
                f,
                "  backward  per key tile of a kv head, per query block of its group: \
                 recompute p = sigmoid from the score; dP = dO V^T; dS = dP p (1 - p) x d \
                 score / d raw; dV += p^T dO, dK += dS^T q, dQ += dS K; dQ, dK rotated \
                 back (RoPE)"
            )?;
        } else {
            writeln!(
                f,
                "  backward  per key tile of a kv head, per query block of its group: \
                 recompute p = 2^(2 (s - lse)) from the saved lse; dP = dO V^T; dS = p (dP \
                 - D) x d score / d raw, D = rowsum(dO out); dV += p^T dO, dK += dS^T q, \
                 dQ += dS K; dQ, dK rotated back (RoPE)"
            )?;
        }
        writeln!(
            f,
            "  d score   {grad}  (natural units per unit of raw score)"
        )?;
        let ds_final = if self.sigmoid() {
            "dP p (1 - p)"
        } else {
            "p (dP - D)"
        };
        for (read, d) in &self.param_grads {
            writeln!(
                f,
                "  d {}[..] += dS_final x {d}  at [{}]  (dS_final = {ds_final})",
                read.name,
                read.indices
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )?;
        }
        Ok(())
    }
}
