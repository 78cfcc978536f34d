use attn_macros::attention;

#[attention(heads = 4, head_dim = 64, targets = [sm_90, sm_75])]
struct Unknown;

#[attention(heads = 4, head_dim = 64, targets = [sm_80, sm_80])]
struct Twice;

#[attention(heads = 4, head_dim = 64, targets = sm_90)]
struct NotAList;

fn main() {}
