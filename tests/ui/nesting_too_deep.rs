use attn::attention;

// Brackets nested past the spec language's limit (32): an error at the first bracket too deep,
// not a compiler crash.
#[attention(
    heads = 2,
    head_dim = 8,
    score_mod = |s, b, h, q, k| ((((((((((((((((((((((((((((((((((((((((s)))))))))))))))))))))))))))))))))))))))),
)]
struct TooDeep;

fn main() {}
