//! The typed API of an attention variant declared with `#[attention(...)]`.

use attn_dsl::{AttentionSpec, DType};
use codegen::KernelPlan;

/// An attention variant whose spec is fixed at compile time.
///
/// `#[attention(...)]` implements it for the annotated struct; the spec is validated when the
/// crate compiles, so [`Attention::spec`] cannot fail. The constants let code be typed by the
/// spec (e.g. buffers sized by `HEAD_DIM`). Running the variant (`forward`, `forward_with_lse`,
/// decode) is added here as the CPU and GPU backends land.
pub trait Attention {
    /// The spec in normalized form.
    const SPEC_TEXT: &'static str;
    /// Query heads.
    const HEADS: u32;
    /// Key/value heads the kernels read (1 for MLA).
    const KV_HEADS: u32;
    /// Query/key head dim (the non-rotary dim for MLA).
    const HEAD_DIM: u32;
    /// Value head dim.
    const V_HEAD_DIM: u32;
    /// Storage dtype.
    const DTYPE: DType;

    /// The spec (parsed once, on first use).
    fn spec() -> &'static AttentionSpec;

    /// The forward kernel plan of the spec.
    fn forward_plan() -> KernelPlan {
        KernelPlan::forward(Self::spec())
    }
}
