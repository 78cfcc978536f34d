use attn::attention;

#[attention(heads = causal, head_dim = 64)]
struct Variant;

fn main() {}
