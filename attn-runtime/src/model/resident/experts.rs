//! Mixture-of-experts MLPs on the device: the router's logits come back and the host routes
//! (`MoeMlp::route`, the CPU's code); each chosen expert runs on the device over its gathered
//! rows and is added back weighted, in expert order.

use super::{DeviceMoe, ResidentModel, blocks, i32_bytes};
use crate::device::{DeviceBuffer, Scratch, f32_bytes, f32s};
use crate::error::RuntimeError;
use crate::model::sublayers::LayerMlp;
use codegen::gpu::kernels::layers;

impl ResidentModel<'_> {
    /// Layer `i`'s mixture of experts over `n` rows `h` (see [`DeviceMoe`]): the shared
    /// expert's rows (gated), then each routed expert's weighted rows added in expert order,
    /// as `MoeMlp::apply` computes on the host.
    pub(super) fn moe(
        &self,
        s: &mut Scratch,
        i: usize,
        moe: &DeviceMoe,
        h: DeviceBuffer,
        n: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let LayerMlp::Moe(host) = &self.model.layers[i].mlp else {
            return Err(RuntimeError::Spec(format!(
                "layer {i} has experts on the device but not in the model"
            )));
        };
        let d = self.model.config.hidden;
        let logits = self.linear(s, &moe.router, h, n)?;
        let routed = host.route(&f32s(&self.device.download(logits)?));
        let out = match &moe.shared {
            Some((expert, gate)) => {
                let y = self.dense(s, expert, h, n)?;
                match gate {
                    Some(gate) => {
                        let g = self.linear(s, gate, h, n)?;
                        let rows: Vec<(usize, f32)> = f32s(&self.device.download(g)?)
                            .into_iter()
                            .map(|g| 1.0 / (1.0 + (-g).exp()))
                            .enumerate()
                            .collect();
                        let out = s.zeros(4 * n * d)?;
                        self.scatter(s, out, y, &rows, d)?;
                        out
                    }
                    None => y,
                }
            }
            None => s.zeros(4 * n * d)?,
        };
        for (expert, rows) in moe.experts.iter().zip(&routed) {
            if rows.is_empty() {
                continue;
            }
            let index = s.upload(&i32_bytes(rows.iter().map(|&(r, _)| r)))?;
            let gathered = s.f32s(rows.len() * d)?;
            self.launch(
                &self.kernels.gather,
                blocks(rows.len() * d)?,
                &layers::GatherArgs {
                    x: h.addr,
                    index: index.addr,
                    out: gathered.addr,
                    rows: rows.len() as i64,
                    width: d as i64,
                },
            )?;
            let y = self.dense(s, expert, gathered, rows.len())?;
            self.scatter(s, out, y, rows, d)?;
        }
        Ok(out)
    }

    /// `out[row] += weight * x[r]` for the `r`-th `(row, weight)` of `rows` (rows of `width`).
    pub(super) fn scatter(
        &self,
        s: &mut Scratch,
        out: DeviceBuffer,
        x: DeviceBuffer,
        rows: &[(usize, f32)],
        width: usize,
    ) -> Result<(), RuntimeError> {
        let index = s.upload(&i32_bytes(rows.iter().map(|&(r, _)| r)))?;
        let weights: Vec<f32> = rows.iter().map(|&(_, w)| w).collect();
        self.launch(
            &self.kernels.scatter,
            blocks(rows.len() * width)?,
            &layers::ScatterArgs {
                out: out.addr,
                x: x.addr,
                index: index.addr,
                weights: s.upload(&f32_bytes(&weights))?.addr,
                rows: rows.len() as i64,
                width: width as i64,
            },
        )
    }
}
