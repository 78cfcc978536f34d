//! AdamW with its moments in the open: the update of `candle_nn::AdamW` (bit for bit: the same
//! tensor operations in the same order), whose state a checkpoint saves and a resumed run loads,
//! so that resuming continues exactly where the run stopped. candle's own keeps its moments
//! private.

use attn::candle::core::backprop::GradStore;
use attn::candle::core::{Result, Tensor, Var};
use std::collections::HashMap;
use std::path::Path;

/// The first and second moments' decay rates, and the denominator's epsilon.
pub const BETAS: (f64, f64) = (0.9, 0.95);
pub const EPS: f64 = 1e-8;

/// One trained tensor: its name, the variable, its moments and its weight decay.
struct Slot {
    name: String,
    var: Var,
    m: Tensor,
    v: Tensor,
    decay: f64,
}

/// AdamW over named variables, each with its own weight decay.
pub struct AdamW {
    slots: Vec<Slot>,
    /// Updates taken: the bias correction's `t`.
    steps: u64,
}

impl AdamW {
    /// AdamW over `vars` (name, variable, weight decay), moments at zero.
    pub fn new(vars: Vec<(String, Var, f64)>) -> Result<AdamW> {
        let slots = vars
            .into_iter()
            .map(|(name, var, decay)| {
                let zeros = var.as_tensor().zeros_like()?;
                Ok(Slot {
                    name,
                    var,
                    m: zeros.clone(),
                    v: zeros,
                    decay,
                })
            })
            .collect::<Result<_>>()?;
        Ok(AdamW { slots, steps: 0 })
    }

    /// One update with learning rate `lr`; variables without a gradient are left as they are.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<()> {
        self.steps += 1;
        let (beta1, beta2) = BETAS;
        let t = i32::try_from(self.steps).unwrap_or(i32::MAX);
        let scale_m = 1f64 / (1f64 - beta1.powi(t));
        let scale_v = 1f64 / (1f64 - beta2.powi(t));
        for slot in &mut self.slots {
            let theta = &slot.var;
            let Some(g) = grads.get(theta) else { continue };
            let next_m = ((&slot.m * beta1)? + (g * (1.0 - beta1))?)?;
            let next_v = ((&slot.v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            let next_theta = (theta.as_tensor() * (1f64 - lr * slot.decay))?;
            let adjusted = (m_hat / (v_hat.sqrt()? + EPS)?)?;
            let next_theta = (next_theta - (adjusted * lr)?)?;
            slot.m = next_m;
            slot.v = next_v;
            theta.set(&next_theta)?;
        }
        Ok(())
    }

    /// Writes the moments to `path` (safetensors, `NAME.exp_avg` and `NAME.exp_avg_sq` as
    /// PyTorch names them).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut tensors = HashMap::new();
        for slot in &self.slots {
            tensors.insert(format!("{}.exp_avg", slot.name), slot.m.clone());
            tensors.insert(format!("{}.exp_avg_sq", slot.name), slot.v.clone());
        }
        attn::candle::core::safetensors::save(&tensors, path)
    }

    /// Takes the moments [`save`](Self::save) wrote after `steps` updates; every variable's
    /// moments must be there with its shape.
    pub fn load(&mut self, path: &Path, steps: u64) -> Result<()> {
        let mut tensors =
            attn::candle::core::safetensors::load(path, &attn::candle::core::Device::Cpu)?;
        for slot in &mut self.slots {
            for (suffix, moment) in [("exp_avg", &mut slot.m), ("exp_avg_sq", &mut slot.v)] {
                let name = format!("{}.{suffix}", slot.name);
                let t = tensors.remove(&name).ok_or_else(|| {
                    attn::candle::core::Error::Msg(format!("`{name}` is missing"))
                })?;
                if t.shape() != slot.var.shape() || t.dtype() != slot.var.dtype() {
                    return Err(attn::candle::core::Error::Msg(format!(
                        "`{name}` is {:?} {:?}; expected {:?} {:?}",
                        t.dtype(),
                        t.shape(),
                        slot.var.dtype(),
                        slot.var.shape()
                    )));
                }
                *moment = t;
            }
        }
        self.steps = steps;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn::candle::core::Device;
    use attn::candle::nn::{Optimizer, ParamsAdamW};

    fn var(seed: u64, shape: &[usize]) -> Var {
        let mut rng = attn::inputs::XorShift::new(seed);
        let n = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| rng.next_f32()).collect();
        Var::from_tensor(&Tensor::from_vec(values, shape, &Device::Cpu).unwrap()).unwrap()
    }

    /// A loss with a gradient in every variable: sum((w - 0.3)^2 * x).
    fn loss(w: &Var, x: &Tensor) -> Tensor {
        (w.as_tensor() - 0.3)
            .unwrap()
            .sqr()
            .unwrap()
            .broadcast_mul(x)
            .unwrap()
            .sum_all()
            .unwrap()
    }

    #[test]
    fn updates_are_candles_bit_for_bit_and_survive_a_save_and_load() {
        let x = var(9, &[3, 4]).as_tensor().clone();
        let (ours, theirs) = (var(1, &[3, 4]), var(1, &[3, 4]));
        let params = ParamsAdamW {
            lr: 0.05,
            beta1: BETAS.0,
            beta2: BETAS.1,
            eps: EPS,
            weight_decay: 0.1,
        };
        let mut candle = attn::candle::nn::AdamW::new(vec![theirs.clone()], params).unwrap();
        let mut adamw = AdamW::new(vec![("w".into(), ours.clone(), 0.1)]).unwrap();
        let dir = std::env::temp_dir().join(format!("attnc-adamw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("optimizer.safetensors");
        for step in 1..=6u64 {
            let lr = 0.05 / step as f64;
            candle.set_learning_rate(lr);
            candle.step(&loss(&theirs, &x).backward().unwrap()).unwrap();
            adamw
                .step(&loss(&ours, &x).backward().unwrap(), lr)
                .unwrap();
            let bits = |v: &Var| -> Vec<u32> {
                v.flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|f| f.to_bits())
                    .collect()
            };
            assert_eq!(bits(&ours), bits(&theirs), "step {step}");
            if step == 3 {
                // A fresh optimizer over the same variable, from the saved moments.
                adamw.save(&path).unwrap();
                adamw = AdamW::new(vec![("w".into(), ours.clone(), 0.1)]).unwrap();
                adamw.load(&path, 3).unwrap();
            }
        }
        // Moments of another shape, or missing, are refused by name.
        let mut other = AdamW::new(vec![("w".into(), var(1, &[4, 3]), 0.1)]).unwrap();
        let e = other.load(&path, 3).unwrap_err().to_string();
        assert!(e.contains("w.exp_avg") && e.contains("expected"), "{e}");
        let mut other = AdamW::new(vec![("u".into(), var(1, &[3, 4]), 0.1)]).unwrap();
        let e = other.load(&path, 3).unwrap_err().to_string();
        assert!(e.contains("`u.exp_avg` is missing"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
