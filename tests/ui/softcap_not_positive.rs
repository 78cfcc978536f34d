use attn::attention;

#[attention(heads = 8, head_dim = 64, softcap = -30.0)]
struct Variant;

fn main() {}
