use attn::attention;

#[attention(heads = 8, head_dim = 64, mask = sliding_window(0))]
struct Variant;

fn main() {}
