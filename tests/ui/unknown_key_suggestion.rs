use attn::attention;

#[attention(heads = 32, kv_hedas = 8, head_dim = 128)]
struct Variant;

fn main() {}
