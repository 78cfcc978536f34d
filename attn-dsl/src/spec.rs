//! The attention spec as plain data: what a variant is, independent of how it is parsed or run.
//!
//! Values here are *resolved*: defaults that depend on other fields (`kv_heads`, `v_head_dim`,
//! the RoPE dim) are filled in by the parser, so two specs that mean the same thing compare equal.
//! The one deliberate exception is [`AttentionSpec::scale`]: `None` means "the default for this
//! shape", which [`AttentionSpec::effective_scale`] computes.

use crate::modifier::{MaskMod, ScoreMod};

/// A complete attention variant.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Number of query heads.
    pub heads: u32,
    /// How keys and values are stored: per-head groups (MHA/GQA/MQA) or an MLA latent.
    pub kv: KvLayout,
    /// Query/key head dimension. With MLA, the per-head non-rotary ("nope") dimension.
    pub head_dim: u32,
    /// Value head dimension (defaults to `head_dim`).
    pub v_head_dim: u32,
    /// The built-in mask.
    pub mask: Mask,
    /// The positional scheme.
    pub position: Position,
    /// Tanh soft-capping of scores: `s = c * tanh(s / c)`.
    pub softcap: Option<f64>,
    /// Explicit score scale; `None` means the default (see [`AttentionSpec::effective_scale`]).
    pub scale: Option<f64>,
    /// Storage dtype of inputs and outputs (accumulation is always f32).
    pub dtype: DType,
    /// A custom score modifier, applied after scale, softcap and ALiBi.
    pub score_mod: Option<ScoreMod>,
    /// A custom mask predicate, ANDed with the built-in mask.
    pub mask_mod: Option<MaskMod>,
    /// Learnable f32 tensors the score modifier reads (`params(NAME: [DIM, ..], ..)`), in the
    /// order declared.
    pub params: Vec<ParamDecl>,
    /// Read-only tensors each call gives (`data(NAME: [DIM, ..] TYPE, ..)`), which the score
    /// and mask modifiers read, in the order declared.
    pub data: Vec<DataDecl>,
    /// Whether each query head has a learned sink logit (`sinks = learned`).
    pub sinks: Sinks,
    /// How a row's final scores become the weights of its values (`normalize = ..`).
    pub normalize: Normalize,
    /// Differential heads (`differential = lambda(init = L)`): query and key heads in pairs
    /// whose weights subtract (see [`Differential`]).
    pub differential: Option<Differential>,
}

/// How a row's final scores (after every modifier) become the weights of its values
/// (docs/semantics.md, "Normalizers").
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Normalize {
    /// `softmax`: `exp(s_ij - lse_i)`, summing to 1 over the row's kept keys (the default).
    #[default]
    Softmax,
    /// `sigmoid(bias = B)`: each kept key weighs `sigmoid(s_ij + B)` on its own (Apple's
    /// sigmoid attention); `lse_i = ln(sum_j sigmoid(s_ij + B))`.
    Sigmoid(SigmoidBias),
    /// `stick_breaking` (Tan et al., 2024): over the kept keys from the nearest (largest
    /// position) to the farthest, `A_ij = sigmoid(s_ij) * prod_{l nearer} (1 - sigmoid(s_il))`;
    /// `lse_i = ln(sum_j A_ij)`.
    StickBreaking,
}

impl Normalize {
    /// The spelling after `normalize =`.
    pub fn name(self) -> String {
        match self {
            Normalize::Softmax => "softmax".to_string(),
            Normalize::Sigmoid(SigmoidBias::Value(0.0)) => "sigmoid".to_string(),
            Normalize::Sigmoid(bias) => format!("sigmoid(bias = {bias})"),
            Normalize::StickBreaking => "stick_breaking".to_string(),
        }
    }
}

/// The bias `B` of sigmoid attention.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SigmoidBias {
    /// A constant.
    Value(f64),
    /// `-ln(n)`, the paper's bias for sequences of `n` tokens (written `-ln(4096)`).
    NegLn(u64),
}

impl SigmoidBias {
    /// The bias as a number.
    pub fn value(self) -> f64 {
        match self {
            SigmoidBias::Value(b) => b,
            SigmoidBias::NegLn(n) => -(n as f64).ln(),
        }
    }
}

impl std::fmt::Display for SigmoidBias {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            SigmoidBias::Value(b) => write!(f, "{b:?}"),
            SigmoidBias::NegLn(n) => write!(f, "-ln({n})"),
        }
    }
}

/// One per-call data tensor: `NAME: [DIM, ...] TYPE` (docs/semantics.md, "Data tensors").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataDecl {
    /// The name modifiers read it by and calls give it by.
    pub name: String,
    /// The dimensions, outermost first (row-major).
    pub dims: Vec<DataDim>,
    /// The element type.
    pub dtype: DataType,
}

/// A dimension of a [`DataDecl`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataDim {
    /// A fixed size.
    Fixed(u32),
    /// The number of query heads.
    Heads,
    /// The number of key/value heads.
    KvHeads,
    /// The call's batch size (in a variable-length call, its number of sequences).
    Batch,
    /// The call's key axis: `Skv` entries, entry `j` for the key at position
    /// `position_offset + j`; a read at position `p` reads entry `p - position_offset`.
    Seq,
}

/// The element type of a [`DataDecl`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataType {
    /// 32-bit integers, read as i64 values (ids, lengths, bounds).
    I32,
    /// 32-bit floats, read as f32 values; a score modifier's reads have a gradient.
    F32,
}

impl DataType {
    /// The name in the spec language.
    pub fn name(self) -> &'static str {
        match self {
            DataType::I32 => "i32",
            DataType::F32 => "f32",
        }
    }

    /// The type a modifier reads an element as.
    pub fn read_ty(self) -> crate::modifier::Ty {
        match self {
            DataType::I32 => crate::modifier::Ty::I64,
            DataType::F32 => crate::modifier::Ty::F32,
        }
    }
}

/// One learnable parameter tensor: `NAME: [DIM, ...]`, or `NAME: [DIM, ...] = INIT`.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamDecl {
    /// The name modifiers read it by (`NAME[i, j]`) and tensors carry it by.
    pub name: String,
    /// The dimensions, outermost first (row-major).
    pub dims: Vec<ParamDim>,
    /// Where training starts it (0 unless the spec says otherwise).
    pub init: ParamInit,
}

/// Where a learnable tensor starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ParamInit {
    /// Every element `value` (0 unless the spec says otherwise).
    Constant(f64),
    /// Independent draws from a normal distribution of mean 0 and this standard deviation.
    Normal(f64),
    /// Independent draws from the uniform distribution on `[low, high)`.
    Uniform(f64, f64),
    /// The ALiBi slopes of the spec's heads (`[heads]` tensors only).
    Alibi,
}

impl Default for ParamInit {
    fn default() -> Self {
        ParamInit::Constant(0.0)
    }
}

impl ParamInit {
    /// Whether this is the default, which the spec's text leaves out.
    pub fn is_default(&self) -> bool {
        *self == ParamInit::default()
    }

    /// What is wrong with it for `decl` in a spec of `heads` query heads, if anything.
    pub fn problem(&self, decl: &ParamDecl) -> Option<String> {
        let name = &decl.name;
        let finite = |x: f64| x.is_finite() && x.abs() <= f64::from(f32::MAX);
        match *self {
            ParamInit::Constant(x) if !finite(x) => Some(format!(
                "`{name}` starts at {x}; allowed: a finite value within f32's range"
            )),
            ParamInit::Normal(std) if !(finite(std) && std > 0.0) => Some(format!(
                "`{name}` = normal({std}): the standard deviation must be finite and above 0"
            )),
            ParamInit::Uniform(low, high) if !(finite(low) && finite(high) && low < high) => {
                Some(format!(
                    "`{name}` = uniform({low}, {high}): allowed: finite bounds with low < high"
                ))
            }
            ParamInit::Alibi if decl.dims != [ParamDim::Heads] => Some(format!(
                "`{name}` = alibi needs the shape [heads] (one slope per query head)"
            )),
            _ => None,
        }
    }
}

impl std::fmt::Display for ParamInit {
    /// The spec's spelling, as after `=`.
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            ParamInit::Constant(x) => write!(f, "{x:?}"),
            ParamInit::Normal(std) => write!(f, "normal({std:?})"),
            ParamInit::Uniform(low, high) => write!(f, "uniform({low:?}, {high:?})"),
            ParamInit::Alibi => write!(f, "alibi"),
        }
    }
}

/// A dimension of a [`ParamDecl`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamDim {
    /// A fixed size.
    Fixed(u32),
    /// The number of query heads.
    Heads,
    /// The number of key/value heads.
    KvHeads,
}

/// Whether rows have a learned sink: an extra softmax logit per query head with no value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sinks {
    /// No sink.
    #[default]
    None,
    /// A tensor `sinks` of shape `[heads]`: row `i` of head `h` has softmax denominator
    /// `sum_j exp(s_ij) + exp(sinks[h])`, and the sink contributes no value.
    Learned,
}

/// The name of the sink tensor in inputs and (as `dsinks`) in gradients.
pub const SINKS_NAME: &str = "sinks";

/// How keys and values are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvLayout {
    /// `kv_heads` key/value heads, each shared by `heads / kv_heads` query heads.
    Heads {
        /// Number of key/value heads.
        kv_heads: u32,
    },
    /// Multi-head latent attention (DeepSeek-V2/V3).
    Mla(Mla),
}

/// Parameters of multi-head latent attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mla {
    /// Rank of the cached latent `c_kv`.
    pub latent_rank: u32,
    /// Dimension of the decoupled rotary part, one key head shared by all query heads.
    pub rope_dim: u32,
}

/// The family a KV layout belongs to, for reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvKind {
    /// One KV head per query head.
    Mha,
    /// Fewer KV heads than query heads, more than one.
    Gqa,
    /// A single KV head.
    Mqa,
    /// A compressed latent shared by all heads.
    Mla,
}

/// Which query each key row is aligned with for causal masking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CausalAlign {
    /// Queries are the last `Sq` positions (decode, chunked prefill). The default.
    BottomRight,
    /// Query `i` is aligned with key `i`.
    TopLeft,
}

/// The built-in mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask {
    /// Every key is visible.
    None,
    /// Keys at or before the query's position are visible.
    Causal(CausalAlign),
    /// Causal (bottom-right), and only the last `window` keys including the query's own.
    SlidingWindow {
        /// Number of visible keys, including the query's own position.
        window: u64,
    },
}

/// The positional scheme.
#[derive(Clone, Debug, PartialEq)]
pub enum Position {
    /// No positional information inside attention.
    None,
    /// Linear biases with the standard per-head slopes.
    Alibi,
    /// Rotary embeddings applied to q and k.
    Rope(Rope),
}

/// Rotary position embedding parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// Frequency base (theta).
    pub base: f64,
    /// Number of leading dimensions rotated (even, at most the rotated head dim).
    pub dim: u32,
    /// How dimensions are paired.
    pub layout: RopeLayout,
    /// Context-extension scaling.
    pub scaling: RopeScaling,
    /// xPos's decay on top of the rotation (`position = xpos(..)`); `None` for plain RoPE.
    pub xpos: Option<XPos>,
}

/// xPos (Sun et al., 2022): rotated pair `i` of a query at position `n` is scaled by
/// `zeta_i^(n / scale_base)` and of a key at position `m` by `zeta_i^(-m / scale_base)`, with
/// `zeta_i = (2i / dim + gamma) / (1 + gamma)`, so the pair's share of the score decays as
/// `zeta_i^((n - m) / scale_base)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct XPos {
    /// Positions per power of `zeta_i` (512 in the paper).
    pub scale_base: f64,
    /// Sets the slowest decay `zeta_0 = gamma / (1 + gamma)` (0.4 in the paper).
    pub gamma: f64,
}

impl XPos {
    /// The paper's values: `scale_base = 512`, `gamma = 0.4`.
    pub const PAPER: XPos = XPos {
        scale_base: 512.0,
        gamma: 0.4,
    };

    /// `zeta_i` for the `half` pairs of a rotated span of `2 * half` dims.
    pub fn zetas(&self, half: usize) -> Vec<f64> {
        let dim = 2.0 * half as f64;
        (0..half)
            .map(|i| (2.0 * i as f64 / dim + self.gamma) / (1.0 + self.gamma))
            .collect()
    }
}

/// How rotary dimensions are paired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// `rotate_half`: pairs `(x[i], x[i + dim/2])` (Llama, Hugging Face).
    Half,
    /// Pairs `(x[2i], x[2i+1])` (GPT-J, original RoFormer).
    Interleaved,
}

impl RopeLayout {
    /// Which dims each pair of a rotated span of `dim` dims takes: every backend rotates by
    /// this, so a layout is defined here and nowhere else.
    pub fn pairing(self, dim: u32) -> Pairing {
        let half = dim as usize / 2;
        match self {
            RopeLayout::Half => Pairing {
                stride: 1,
                partner: half,
                half,
            },
            RopeLayout::Interleaved => Pairing {
                stride: 2,
                partner: 1,
                half,
            },
        }
    }
}

/// The pairs of a rotated span: pair `i` (for `i < half`, rotated at frequency `i`) is dims
/// `stride * i` and `stride * i + partner` from the span's first dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pairing {
    /// Dims between the first elements of consecutive pairs.
    pub stride: usize,
    /// Dims from a pair's first element to its second.
    pub partner: usize,
    /// Pairs in the span.
    pub half: usize,
}

impl Pairing {
    /// The dims of pair `i`, from the span's first dim.
    pub fn pair(self, i: usize) -> (usize, usize) {
        let a = self.stride * i;
        (a, a + self.partner)
    }

    /// The pair dim `d` (from the span's first dim, below `2 * half`) belongs to, and whether
    /// it is the pair's first element.
    pub fn owner(self, d: usize) -> (usize, bool) {
        let (i, first) = if self.stride == 1 {
            (d % self.half, d < self.half)
        } else {
            (d / self.stride, d.is_multiple_of(self.stride))
        };
        debug_assert_eq!(
            self.pair(i),
            if first {
                (d, d + self.partner)
            } else {
                (d - self.partner, d)
            }
        );
        (i, first)
    }

    /// Whether a pair's elements are adjacent (one 32-bit word of two 16-bit values).
    pub fn adjacent(self) -> bool {
        self.partner == 1
    }
}

/// RoPE context-extension scalings, as the transformers library defines them.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Position interpolation: `inv_freq / factor`.
    Linear {
        /// Interpolation factor.
        factor: f64,
    },
    /// Static NTK-aware: `base' = base * factor^(dim/(dim-2))`.
    Ntk {
        /// Scaling factor.
        factor: f64,
    },
    /// Dynamic NTK: the base grows with the current length once it exceeds the original.
    Dynamic {
        /// Scaling factor.
        factor: f64,
        /// Context length the model was trained with.
        original_max_position: u64,
    },
    /// YaRN: frequency-dependent interpolation plus an attention factor.
    Yarn(Yarn),
    /// Llama 3.1: wavelength-dependent blend of interpolated and original frequencies.
    Llama3 {
        /// Interpolation factor for low frequencies.
        factor: f64,
        /// Wavelengths above `original_max_position / low_freq_factor` are fully interpolated.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// Context length the model was trained with.
        original_max_position: u64,
    },
    /// LongRoPE (Phi-3): each frequency divided by its own factor, from `short` while the
    /// sequence fits the original context and from `long` beyond it, and cos and sin times an
    /// attention factor.
    LongRope(LongRope),
}

/// LongRoPE parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct LongRope {
    /// One factor per rotated pair (`dim / 2`), for sequences of at most
    /// `original_max_position` tokens.
    pub short: std::sync::Arc<[f64]>,
    /// One factor per rotated pair, for longer sequences.
    pub long: std::sync::Arc<[f64]>,
    /// Context length the model was trained with: a call whose sequence (`Skv + p0`) is longer
    /// uses the long factors.
    pub original_max_position: u64,
    /// The factor on cos and sin.
    pub attention_factor: f64,
}

/// YaRN parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// Context extension factor (at least 1).
    pub factor: f64,
    /// Context length the model was trained with.
    pub original_max_position: u64,
    /// Rotations above which dimensions are extrapolated (default 32).
    pub beta_fast: f64,
    /// Rotations below which dimensions are interpolated (default 1).
    pub beta_slow: f64,
    /// Optional attention-factor numerator parameter.
    pub mscale: Option<f64>,
    /// Optional attention-factor denominator parameter.
    pub mscale_all_dim: Option<f64>,
    /// The correction range's ends are rounded outward to whole dims (true, the default);
    /// gpt-oss keeps them fractional.
    pub truncate: bool,
}

/// Storage dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    /// The name used in the spec language.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }
}

impl AttentionSpec {
    /// A spec with the given heads and head dim and every other field at its default
    /// (MHA, no mask, no positions, f32).
    pub fn new(heads: u32, head_dim: u32) -> Self {
        AttentionSpec {
            heads,
            kv: KvLayout::Heads { kv_heads: heads },
            head_dim,
            v_head_dim: head_dim,
            mask: Mask::None,
            position: Position::None,
            softcap: None,
            scale: None,
            dtype: DType::F32,
            score_mod: None,
            mask_mod: None,
            params: Vec::new(),
            data: Vec::new(),
            sinks: Sinks::None,
            normalize: Normalize::Softmax,
            differential: None,
        }
    }

    /// The declared data tensor called `name`.
    pub fn data_decl(&self, name: &str) -> Option<&DataDecl> {
        self.data.iter().find(|d| d.name == name)
    }

    /// The shape of a declared data tensor in a call of `batch` items over `seq` keys.
    pub fn data_shape(&self, decl: &DataDecl, batch: usize, seq: usize) -> Vec<usize> {
        decl.dims
            .iter()
            .map(|d| match d {
                DataDim::Fixed(n) => *n as usize,
                DataDim::Heads => self.heads as usize,
                DataDim::KvHeads => self.kv_heads() as usize,
                DataDim::Batch => batch,
                DataDim::Seq => seq,
            })
            .collect()
    }

    /// The shape of a declared parameter, its dimensions resolved against this spec.
    pub fn param_shape(&self, decl: &ParamDecl) -> Vec<usize> {
        decl.dims
            .iter()
            .map(|d| match d {
                ParamDim::Fixed(n) => *n as usize,
                ParamDim::Heads => self.heads as usize,
                ParamDim::KvHeads => self.kv_heads() as usize,
            })
            .collect()
    }

    /// The declared parameter called `name`.
    pub fn param(&self, name: &str) -> Option<&ParamDecl> {
        self.params.iter().find(|p| p.name == name)
    }

    /// Every learnable tensor the spec takes, with its shape: the declared parameters in order,
    /// then `sinks` (`[heads]`) when the spec has learned sinks.
    pub fn learnable_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let mut all: Vec<_> = self
            .params
            .iter()
            .map(|p| (p.name.clone(), self.param_shape(p)))
            .collect();
        if self.sinks == Sinks::Learned {
            all.push((SINKS_NAME.to_string(), vec![self.heads as usize]));
        }
        all
    }

    /// Number of distinct key/value heads a kernel reads (1 for MLA: the latent is shared).
    pub fn kv_heads(&self) -> u32 {
        match self.kv {
            KvLayout::Heads { kv_heads } => kv_heads,
            KvLayout::Mla(_) => 1,
        }
    }

    /// The family of the KV layout.
    pub fn kv_kind(&self) -> KvKind {
        match self.kv {
            KvLayout::Mla(_) => KvKind::Mla,
            KvLayout::Heads { kv_heads } if kv_heads == self.heads => KvKind::Mha,
            KvLayout::Heads { kv_heads: 1 } => KvKind::Mqa,
            KvLayout::Heads { .. } => KvKind::Gqa,
        }
    }

    /// The MLA parameters, if this is an MLA spec.
    pub fn mla(&self) -> Option<Mla> {
        match self.kv {
            KvLayout::Mla(mla) => Some(mla),
            KvLayout::Heads { .. } => None,
        }
    }

    /// Dimension of the per-head query/key vectors in the expanded form
    /// (`head_dim`, plus `rope_dim` with MLA).
    pub fn qk_dim(&self) -> u32 {
        match self.kv {
            KvLayout::Heads { .. } => self.head_dim,
            KvLayout::Mla(mla) => self.head_dim + mla.rope_dim,
        }
    }

    /// The dimension RoPE rotates within: `head_dim`, or `rope_dim` with MLA.
    pub fn rotary_span(&self) -> u32 {
        match self.kv {
            KvLayout::Heads { .. } => self.head_dim,
            KvLayout::Mla(mla) => mla.rope_dim,
        }
    }

    /// The scale applied to `<q, k>`: the explicit one, else `1/sqrt(qk_dim)`.
    pub fn effective_scale(&self) -> f64 {
        self.scale
            .unwrap_or_else(|| 1.0 / f64::from(self.qk_dim()).sqrt())
    }

    /// The RoPE parameters, if the positional scheme is RoPE.
    pub fn rope(&self) -> Option<&Rope> {
        match &self.position {
            Position::Rope(rope) => Some(rope),
            _ => None,
        }
    }
}

impl Rope {
    /// RoPE with the given rotated dimension and every other parameter at its default
    /// (base 10000, half layout, no scaling).
    pub fn with_dim(dim: u32) -> Self {
        Rope {
            base: 10000.0,
            dim,
            layout: RopeLayout::Half,
            scaling: RopeScaling::None,
            xpos: None,
        }
    }
}

impl Yarn {
    /// YaRN with the given factor and original context, other parameters at their defaults.
    pub fn new(factor: f64, original_max_position: u64) -> Self {
        Yarn {
            factor,
            original_max_position,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        }
    }
}

/// The differential heads of a spec.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Differential {
    /// The constant added to the learned part of lambda (the paper's `lambda_init`, 0.8 for
    /// deep layers; `0.8 - 0.6 * exp(-0.3 * (layer - 1))` by depth).
    pub lambda_init: f64,
}

/// The names of the four learnable vectors of lambda, in the order
/// `exp(q1 . k1) - exp(q2 . k2)`.
pub const LAMBDA_NAMES: [&str; 4] = ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"];

impl Differential {
    /// The paper's constant for deep layers: `lambda_init = 0.8`.
    pub const PAPER: Differential = Differential { lambda_init: 0.8 };

    /// The paper's `lambda_init` for layer `layer` (from 1): `0.8 - 0.6 * exp(-0.3 * (layer - 1))`.
    pub fn by_depth(layer: u32) -> Differential {
        Differential {
            lambda_init: 0.8 - 0.6 * (-0.3 * (f64::from(layer) - 1.0)).exp(),
        }
    }

    /// lambda for the vectors `[q1, k1, q2, k2]`.
    pub fn lambda(&self, vectors: [&[f64]; 4]) -> f64 {
        let [q1, k1, q2, k2] = vectors;
        dot(q1, k1).exp() - dot(q2, k2).exp() + self.lambda_init
    }

    /// The gradients of lambda with respect to `[q1, k1, q2, k2]`:
    /// `exp(q1 . k1) k1`, `exp(q1 . k1) q1`, `-exp(q2 . k2) k2`, `-exp(q2 . k2) q2`.
    pub fn lambda_gradients(&self, vectors: [&[f64]; 4]) -> [Vec<f64>; 4] {
        let [q1, k1, q2, k2] = vectors;
        let (e1, e2) = (dot(q1, k1).exp(), dot(q2, k2).exp());
        let scaled = |x: &[f64], by: f64| x.iter().map(|v| v * by).collect::<Vec<f64>>();
        [
            scaled(k1, e1),
            scaled(q1, e1),
            scaled(k2, -e2),
            scaled(q2, -e2),
        ]
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
