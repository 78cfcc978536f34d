//! Invalid specs, one struct each: every error lands under the tokens that caused it, and
//! each struct's error is reported (one failing build, not one per case).

use attn_macros::attention;

#[attention(heads = 8 head_dim = 64)]
struct MissingComma;

#[attention(heads = 8, head_dim = 64, heads = 4)]
struct DuplicateKey;

#[attention(heads = 8, kv_heads = 2)]
struct MissingHeadDim;

#[attention(heads = causal, head_dim = 64)]
struct WrongValueType;

#[attention(heads = 32, kv_hedas = 8, head_dim = 128)]
struct UnknownKeySuggestion;

#[attention(heads = 8, head_dim = 64, mask = causa)]
struct UnknownMask;

#[attention(heads = 32, kv_heads = 5, head_dim = 128)]
struct KvHeadsNotADivisor;

#[attention(
    heads = 8,
    head_dim = 64,
    kv_heads = 3,
    dtype = fp8,
)]
struct SeveralErrors;

#[attention(heads = 8, head_dim = 64, mask = sliding_window(0))]
struct SlidingWindowZero;

#[attention(heads = 8, head_dim = 64, softcap = -30.0)]
struct SoftcapNotPositive;

#[attention(heads = 8, head_dim = 64, position = rope(dim = 63))]
struct OddRopeDim;

#[attention(heads = 8, head_dim = 64, position = rope(dim = 128))]
struct RopeDimAboveHeadDim;

#[attention(heads = 16, head_dim = 128, mla(latent_rank = 512))]
struct MlaWithoutRopeDim;

#[attention(heads = 8, head_dim = 64, position = rope(scaling = yarn(factor = 0.5, original_max_position = 4096)))]
struct YarnFactorBelowOne;

#[attention(heads = 8, head_dim = 64, score_mod = |score, b, h, q, k| score * q)]
struct ScoreModTypeMismatch;

#[attention(heads = 8, head_dim = 64, mask_mod = |b, h, q, k| q - k)]
struct MaskModNotBool;

#[attention(heads = 8, head_dim = 64, mask_mod = |b, h, q, k| pos < k)]
struct MaskModUnknownName;

// Brackets nested past the spec language's limit (32): an error at the first bracket too deep,
// not a compiler crash.
#[attention(
    heads = 2,
    head_dim = 8,
    score_mod = |s, b, h, q, k| ((((((((((((((((((((((((((((((((((((((((s)))))))))))))))))))))))))))))))))))))))),
)]
struct NestingTooDeep;

// A parameter read whose index interval analysis cannot prove in range: an error at the read.
#[attention(
    heads = 2,
    head_dim = 8,
    params(rel: [heads, 32]),
    score_mod = |s, b, h, q, k| s + rel[h, q - k],
)]
struct IndexNotProved;

// A parameter declared twice: an error at the second declaration.
#[attention(heads = 2, head_dim = 8, params(a: [2], a: [heads]), score_mod = |s, b, h, q, k| s * a[0])]
struct ParamTwice;

fn main() {}
