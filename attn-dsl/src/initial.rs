//! Initial values of learnable tensors: `params(NAME: [DIM, ..] = INIT)`, with `INIT` one of a
//! constant (`0.5`; the default is 0), `normal(STD)` (mean 0), `uniform(LOW, HIGH)` or `alibi`
//! (the ALiBi slopes of the spec's heads, for a `[heads]` tensor). Learned sinks start at 0.
//!
//! Random values come from [`XorShift`](crate::inputs::XorShift) seeded by the caller and the
//! tensor's name, so a model's start is the same on every machine for the same seed.

use crate::inputs::XorShift;
use crate::spec::{AttentionSpec, ParamInit};

impl ParamInit {
    /// `len` initial values, for a spec of `heads` query heads; `seed` picks random draws.
    pub fn values(&self, len: usize, heads: u32, seed: u64) -> Vec<f32> {
        let mut rng = XorShift::new(seed);
        // In (0, 1]: its logarithm is finite.
        let mut unit = move || ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        match *self {
            ParamInit::Constant(x) => vec![x as f32; len],
            ParamInit::Normal(std) => (0..len)
                .map(|_| {
                    // Box-Muller: two uniforms make one standard normal value.
                    let (u, v) = (unit(), unit());
                    let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
                    (z * std) as f32
                })
                .collect(),
            ParamInit::Uniform(low, high) => (0..len)
                .map(|_| (low + (high - low) * (1.0 - unit())) as f32)
                .collect(),
            ParamInit::Alibi => {
                let mut slopes: Vec<f32> = crate::reference::alibi::slopes(heads)
                    .into_iter()
                    .map(|s| s as f32)
                    .collect();
                slopes.resize(len, 0.0);
                slopes
            }
        }
    }
}

/// One learnable tensor's name, shape and initial values.
pub type InitialTensor = (String, Vec<usize>, Vec<f32>);

impl AttentionSpec {
    /// Every learnable tensor ([`AttentionSpec::learnable_tensors`]) with its initial values;
    /// random ones drawn from `seed` and the tensor's name. Learned sinks start at 0.
    pub fn initial_values(&self, seed: u64) -> Vec<InitialTensor> {
        self.learnable_tensors()
            .into_iter()
            .map(|(name, shape)| {
                let len = shape.iter().product();
                let init = self
                    .params
                    .iter()
                    .find(|p| p.name == name)
                    .map_or(ParamInit::default(), |p| p.init);
                let values = init.values(len, self.heads, seed ^ name_hash(&name));
                (name, shape, values)
            })
            .collect()
    }
}

impl AttentionSpec {
    /// The initial values of differential heads' lambda vectors
    /// ([`AttentionSpec::lambda_tensors`]): normal(0.1), the paper's, drawn from `seed` and each
    /// vector's name; none without differential heads.
    pub fn lambda_initial_values(&self, seed: u64) -> Vec<InitialTensor> {
        self.lambda_tensors()
            .into_iter()
            .map(|(name, shape)| {
                let values =
                    ParamInit::Normal(0.1).values(shape[0], self.heads, seed ^ name_hash(&name));
                (name, shape, values)
            })
            .collect()
    }
}

/// FNV-1a of a tensor's name: each tensor draws its own sequence.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Whether training could move the spec's learnable tensors from where they start: `Some`
/// with a note when every learnable tensor's gradient is exactly 0 at its initial values for
/// random inputs (a saddle, as KERPLE's `s - r1 * ln(1 + r2 * |q - k|)` at `r1 = r2 = 0`), so
/// that no optimizer step would change them. `None` when they move, when the spec has no
/// learnable tensors, and where the probe does not apply (MLA, data tensors: the gradient
/// there depends on a call's data).
pub fn stuck_at_start(spec: &AttentionSpec) -> Option<String> {
    use crate::modifier::ParamValues;
    use crate::reference::{Array, Inputs, backward_learned};
    if spec.learnable_tensors().is_empty() || spec.mla().is_some() || !spec.data.is_empty() {
        return None;
    }
    let (heads, kv_heads) = (spec.heads as usize, spec.kv_heads() as usize);
    let (dk, dv, seq) = (spec.head_dim as usize, spec.v_head_dim as usize, 8);
    let random = |shape: &[usize], seed: u64| {
        let n = shape.iter().product();
        Array::from_vec(shape, crate::inputs::values_f64(n, seed)).expect("sized to the shape")
    };
    let (q, k) = (
        random(&[1, heads, seq, dk], 1),
        random(&[1, kv_heads, seq, dk], 2),
    );
    let (v, dout) = (
        random(&[1, kv_heads, seq, dv], 3),
        random(&[1, heads, seq, dv], 4),
    );
    let learned: Vec<ParamValues> = spec
        .initial_values(0)
        .into_iter()
        .map(|(name, shape, values)| ParamValues {
            name,
            shape,
            values: values.into_iter().map(f64::from).collect(),
        })
        .collect();
    let inputs = Inputs {
        q: &q,
        k: &k,
        v: &v,
        position_offset: 0,
    };
    let grads = backward_learned(spec, &inputs, &dout, &learned).ok()?;
    let stuck = grads
        .learned
        .iter()
        .all(|g| g.values.iter().all(|&x| x == 0.0));
    stuck.then(|| {
        let names: Vec<&str> = learned.iter().map(|t| t.name.as_str()).collect();
        format!(
            "the learnable tensors ({}) all start where their gradient is 0, so training \
             cannot move them; start one elsewhere, e.g. `params({}: [..] = normal(0.02))` \
             or `= 0.5`",
            names.join(", "),
            names[0]
        )
    })
}
