use attn::attention;

#[attention(heads = 16, head_dim = 128, mla(latent_rank = 512))]
struct Variant;

fn main() {}
