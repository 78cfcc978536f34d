//! `normalize = ..`: how a row's scores become weights; `differential = ..`: how the weights
//! of a pair of heads combine.

use super::values::Value;
use crate::spec::{Differential, Normalize, SigmoidBias};

/// `none`, `lambda` (the paper's `init = 0.8`) or `lambda(init = L)`.
pub(super) fn differential(v: &Value) -> syn::Result<Option<Differential>> {
    const FORMS: &str = "none, lambda, lambda(init = L)";
    if let Some(word) = v.as_word() {
        return match word.as_str() {
            "none" => Ok(None),
            "lambda" => Ok(Some(Differential::PAPER)),
            _ => Err(v.expected(FORMS)),
        };
    }
    match v.as_call() {
        Some((name, args)) if name == "lambda" => {
            let mut named = args.named("lambda", &["init"])?;
            let lambda_init = match named.take("init") {
                Some((_, init)) => init.float()?,
                None => Differential::PAPER.lambda_init,
            };
            Ok(Some(Differential { lambda_init }))
        }
        _ => Err(v.expected(FORMS)),
    }
}

/// `softmax`, `sigmoid`, `sigmoid(bias = B)`, `sigmoid(bias = -ln(N))` or `stick_breaking`.
pub(super) fn normalize(v: &Value) -> syn::Result<Normalize> {
    const FORMS: &str =
        "softmax, sigmoid, sigmoid(bias = B), sigmoid(bias = -ln(N)), stick_breaking";
    if let Some(word) = v.as_word() {
        return match word.as_str() {
            "softmax" => Ok(Normalize::Softmax),
            "sigmoid" => Ok(Normalize::Sigmoid(SigmoidBias::Value(0.0))),
            "stick_breaking" => Ok(Normalize::StickBreaking),
            _ => Err(v.expected(FORMS)),
        };
    }
    match v.as_call() {
        Some((name, args)) if name == "sigmoid" => {
            let mut named = args.named("sigmoid", &["bias"])?;
            let Some((_, bias)) = named.take("bias") else {
                return Ok(Normalize::Sigmoid(SigmoidBias::Value(0.0)));
            };
            Ok(Normalize::Sigmoid(match bias.neg_ln()? {
                Some(n) => SigmoidBias::NegLn(n),
                None => SigmoidBias::Value(bias.float()?),
            }))
        }
        _ => Err(v.expected(FORMS)),
    }
}
