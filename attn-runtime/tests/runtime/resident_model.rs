//! Models resident on a device (`ResidentModel`), run on gpu-sim (`SimDevice`: GPU IR kernels on
//! the interpreter, host GEMMs for cuBLAS): weights uploaded once, every activation in device
//! memory, logits against transformers' and the CPU model's.

use attn_runtime::device::{Device, SimDevice, f32_bytes, f32s};
use attn_runtime::model::research::config_from_toml;
use attn_runtime::model::{Model, ResidentModel, hf};
use safetensors::SafeTensors;
use std::path::PathBuf;
use std::sync::Arc;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/hf-tiny"
    ))
    .join(name)
}

fn max_rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
        .fold(0.0, f32::max)
}

#[test]
fn a_checkpoint_on_the_device_matches_transformers() {
    checkpoint_on_the_device("llama_gqa");
}

/// starcoder2 runs resident too: LayerNorms with biases, a biased GELU MLP, biased attention
/// projections, a sliding window.
#[test]
fn starcoder2_on_the_device_matches_transformers() {
    checkpoint_on_the_device("starcoder2");
}

/// phi3 too: projections fused in the checkpoint (split at load), RoPE on half of each head.
#[test]
fn phi3_on_the_device_matches_transformers() {
    checkpoint_on_the_device("phi3");
}

/// Every family runs resident: layers of several attention kinds (sliding and
/// full, with and without RoPE, a RoPE per kind), every norm placement, q/k norms, bias-free
/// LayerNorms, GeGLU and the exact GELU, multipliers and softcaps, an embedding norm, ALiBi
/// and LongRoPE (frequencies chosen by the length of each call), mixtures of experts (routed on
/// the host; shared experts, gated or not; gpt-oss's biased experts beside its sinks) and MLA
/// (absorbed by per-head GEMMs, with factored queries in DeepSeek-V3). One test per family.
macro_rules! resident_families {
    ($($family:ident),* $(,)?) => {
        mod every_family_runs_resident_and_matches_transformers {
            $(
                #[test]
                fn $family() {
                    super::checkpoint_on_the_device(stringify!($family));
                }
            )*
        }
    };
}

resident_families!(
    helium,
    mistral,
    qwen2_sliding,
    qwen3_sliding,
    smollm3_nope,
    gemma,
    gemma2_softcap,
    gemma3_text,
    olmo2,
    granite,
    cohere,
    cohere_qk_norm,
    gpt_neox,
    bloom,
    phi3_longrope,
    mixtral_moe,
    qwen2_moe,
    qwen3_moe,
    gpt_oss,
    deepseek_v2_lite_mla,
    deepseek_v2_moe,
    deepseek_v3_moe,
);

fn checkpoint_on_the_device(name: &str) {
    let dir = fixture(name);
    let model = hf::load(&dir).unwrap();
    let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tokens: Vec<u32> = st
        .tensor("input_ids")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    let want = f32s(st.tensor("logits").unwrap().data());
    let on_device = ResidentModel::new(&model, Arc::new(SimDevice::new())).unwrap();
    let got = on_device.forward(&tokens).unwrap();
    let err = max_rel(&got, &want);
    assert!(err < 1e-4, "{name}: max relative difference {err}");
    // Prefill 24 tokens, then one at a time, against caches on the device.
    let want = f32s(st.tensor("logits_incremental").unwrap().data());
    let mut session = on_device.session(tokens.len()).unwrap();
    let mut got = session.step(&tokens[..24]).unwrap();
    for t in 24..tokens.len() {
        got.extend(session.step(&tokens[t..t + 1]).unwrap());
    }
    assert_eq!(session.len(), tokens.len());
    let err = max_rel(&got, &want);
    assert!(
        err < 1e-4,
        "{name} incremental: max relative difference {err}"
    );
    // The cache is full: one more token is an error.
    let e = session.step(&[1]).unwrap_err().to_string();
    assert!(e.contains("do not fit"), "{e}");
}

/// Greedy generation resident on the device (caches there, the argmax there, only the chosen
/// ids back) continues the tokenizer fixture's prompts as transformers does.
#[test]
fn greedy_steps_on_the_device_continue_as_transformers_does() {
    let dir = fixture("llama_tokenizer");
    let model = hf::load(&dir).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden_generate.json")).unwrap())
            .unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let on_device = ResidentModel::new(&model, Arc::new(SimDevice::new())).unwrap();
    for g in json["generate"].as_array().unwrap() {
        let (prompt, want) = (ids(&g["prompt_ids"]), ids(&g["new_ids"]));
        let mut session = on_device.session(prompt.len() + want.len()).unwrap();
        let mut next = session.step_greedy(&prompt).unwrap();
        let mut got = vec![next];
        while got.len() < want.len() {
            next = session.step_greedy(&[next]).unwrap();
            got.push(next);
        }
        assert_eq!(got, want, "{}", g["prompt"]);
    }
}

/// Research models of every block kind on the device against the same model on the CPU.
#[test]
fn research_models_on_the_device_match_the_cpu() {
    for (attention, extra, tol) in [
        (
            "heads = 4, kv_heads = 2, head_dim = 12, mask = causal, position = rope",
            "",
            1e-4,
        ),
        (
            "heads = 2, head_dim = 24, mask = sliding_window(5), position = alibi",
            "norm = \"layer\"\nmlp = \"gelu\"\ntie_embeddings = false\nqkv_bias = true",
            1e-4,
        ),
        // bf16 attention: q, k and v packed to bf16 for the tensor-core kernel.
        (
            "heads = 2, head_dim = 16, mask = causal, dtype = bf16, position = rope(dim = 8)",
            "",
            3e-2,
        ),
        // RoPE over every column (llama): bf16 Q K^T operands on the device.
        (
            "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, dtype = bf16, position = rope",
            "",
            3e-2,
        ),
        // MLA: absorbed on the device, one latent head through the kernel.
        (
            "heads = 2, head_dim = 8, mla(latent_rank = 16, rope_dim = 4), mask = causal",
            "",
            1e-4,
        ),
        // The papers' normalizers: stick-breaking (the SIMT kernels, a row's keys in one task
        // from the nearest) and sigmoid in bf16 (the tensor-core forward and decode).
        (
            "heads = 4, kv_heads = 2, head_dim = 12, mask = causal, position = rope, \
             normalize = stick_breaking",
            "",
            1e-4,
        ),
        (
            "heads = 2, head_dim = 16, mask = causal, dtype = bf16, position = rope(dim = 8), \
             normalize = sigmoid(bias = -2.0)",
            "",
            3e-2,
        ),
    ] {
        let config = config_from_toml(&format!(
            "vocab = 61\nhidden = 48\nlayers = 2\nattention = \"{attention}\"\n{extra}"
        ))
        .unwrap();
        let model = Model::random(&config, 3).unwrap();
        let tokens: Vec<u32> = (0..19).map(|i| (i * 7 + 3) % 61).collect();
        let want = model.forward(&tokens).unwrap();
        let on_device = ResidentModel::new(&model, Arc::new(SimDevice::new())).unwrap();
        let got = on_device.forward(&tokens).unwrap();
        let err = max_rel(&got, &want);
        assert!(
            err < tol,
            "{attention} {extra}: max relative difference {err}"
        );
        // Prefill then one token at a time against the caches on the device: the same
        // logits (the mask is causal everywhere here).
        let mut session = on_device.session(tokens.len()).unwrap();
        let mut steps = session.step(&tokens[..11]).unwrap();
        for t in 11..tokens.len() {
            steps.extend(session.step(&tokens[t..t + 1]).unwrap());
        }
        let err = max_rel(&steps, &want);
        assert!(err < tol, "{attention} {extra} incremental: {err}");
        // A token outside the vocabulary is an error, not a read past the table.
        let e = on_device.forward(&[1, 61]).unwrap_err().to_string();
        assert!(e.contains("outside the vocabulary"), "{e}");
    }
}

/// The gpu-sim device's GEMM over 16-bit weights: the weights widened exactly, products in
/// f32 against f64 sums.
#[test]
fn device_gemms_take_16_bit_weights() {
    let device = SimDevice::new();
    let (n, inp, out) = (3, 20, 7);
    let x: Vec<f32> = (0..n * inp).map(|i| (i % 13) as f32 / 13.0 - 0.4).collect();
    let w: Vec<f32> = (0..out * inp)
        .map(|i| (i % 11) as f32 / 11.0 - 0.5)
        .collect();
    for dtype in [
        attn_dsl::DType::Bf16,
        attn_dsl::DType::F16,
        attn_dsl::DType::F32,
    ] {
        let (bytes, widened): (Vec<u8>, Vec<f32>) = match dtype {
            attn_dsl::DType::Bf16 => (
                w.iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect(),
                w.iter()
                    .map(|v| half::bf16::from_f32(*v).to_f32())
                    .collect(),
            ),
            attn_dsl::DType::F16 => (
                w.iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                    .collect(),
                w.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect(),
            ),
            attn_dsl::DType::F32 => (f32_bytes(&w), w.clone()),
        };
        let (xb, wb) = (
            device.upload(&f32_bytes(&x)).unwrap(),
            device.upload(&bytes).unwrap(),
        );
        let y = device.zeros(4 * n * out).unwrap();
        device.gemm_t(xb, wb, dtype, y, n, inp, out).unwrap();
        let got = f32s(&device.download(y).unwrap());
        for r in 0..n {
            for c in 0..out {
                let want: f64 = (0..inp)
                    .map(|i| f64::from(x[r * inp + i]) * f64::from(widened[c * inp + i]))
                    .sum();
                assert!(
                    (f64::from(got[r * out + c]) - want).abs() < 1e-5,
                    "{dtype:?}"
                );
            }
        }
        // A product larger than its buffers is an error.
        assert!(device.gemm_t(xb, wb, dtype, y, n + 1, inp, out).is_err());
        device.free(xb);
        assert!(device.download(xb).is_err());
    }
}

/// Long enough that decode steps split the cache into several partitions per work item, merged
/// by the device's lse merge.
#[test]
fn long_sequences_split_and_merge_on_the_device() {
    let config = config_from_toml(
        "vocab = 53\nhidden = 32\nlayers = 1\nattention = \"heads = 4, kv_heads = 1, \
         head_dim = 8, mask = causal, position = rope\"",
    )
    .unwrap();
    let model = Model::random(&config, 9).unwrap();
    let tokens: Vec<u32> = (0..300).map(|i| (i * 11 + 5) % 53).collect();
    let want = model.forward(&tokens).unwrap();
    let on_device = ResidentModel::new(&model, Arc::new(SimDevice::new())).unwrap();
    let mut session = on_device.session(tokens.len()).unwrap();
    let mut got = session.step(&tokens[..297]).unwrap();
    for t in 297..300 {
        got.extend(session.step(&tokens[t..t + 1]).unwrap());
    }
    let err = max_rel(&got, &want);
    assert!(err < 1e-4, "max relative difference {err}");
}

/// Sizes past what the device can hold are errors before any allocation.
#[test]
fn hostile_sizes_are_refused() {
    let config = config_from_toml(
        "vocab = 17\nhidden = 16\nlayers = 1\nattention = \"heads = 2, head_dim = 8\"",
    )
    .unwrap();
    let model = Model::random(&config, 2).unwrap();
    let on_device = ResidentModel::new(&model, Arc::new(SimDevice::new())).unwrap();
    for capacity in [usize::MAX, usize::MAX / 8, 1 << 50] {
        assert!(on_device.session(capacity).is_err(), "capacity {capacity}");
    }
    let mut session = on_device.session(4).unwrap();
    assert!(session.step(&[]).is_err());
    assert!(session.step(&[1, 2, 3, 4, 5]).is_err());
    assert!(session.step(&[17]).is_err());
    assert!(session.is_empty(), "a refused step changes nothing");
    assert!(on_device.forward(&[]).unwrap().is_empty());
}

/// Sampled and greedy generation resident on the device choose what the CPU model chooses
/// (the same seeded sampler over logits that agree to 1e-5), and stop at stop tokens.
#[test]
fn resident_generation_chooses_as_the_cpu_model() {
    use attn_runtime::model::{Request, Sampling};
    let config = config_from_toml(
        "vocab = 41\nhidden = 32\nlayers = 2\nattention = \"heads = 4, kv_heads = 2, \
         head_dim = 8, mask = causal, position = rope\"",
    )
    .unwrap();
    let model = Model::random(&config, 4).unwrap();
    let on_device = ResidentModel::new(&model, Arc::new(SimDevice::new())).unwrap();
    let sampled = Sampling {
        temperature: 0.8,
        top_k: Some(20),
        top_p: Some(0.95),
        seed: 7,
    };
    for sampling in [Sampling::greedy(), sampled] {
        let request = Request {
            prompt: vec![3, 1, 4, 1, 5],
            max_new_tokens: 12,
            stop: Vec::new(),
        };
        let want = model
            .generate(std::slice::from_ref(&request), sampling, |_| {})
            .unwrap();
        let mut steps = 0;
        let got = on_device
            .generate(&request, sampling, |_| steps += 1)
            .unwrap();
        assert_eq!(got, want[0], "{sampling:?}");
        assert_eq!(steps, 12);
        // A stop token ends the request after it.
        let stop = Request {
            stop: vec![got[3]],
            ..request
        };
        let first = got.iter().position(|t| *t == got[3]).unwrap();
        let short = on_device.generate(&stop, sampling, |_| {}).unwrap();
        assert_eq!(short, got[..=first].to_vec());
    }
}
