use attn_macros::attention;

#[attention(heads = 4, head_dim = 64, targets = [sm_90])]
struct Embedded;

fn main() {}
