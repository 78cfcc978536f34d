//! The grid of a sweep: `--vary KEY=V1,V2,...` axes, their product, and each combination
//! applied to the base model's TOML (TOML keys) or to its `attention` spec (spec keys).

use attn::research;
use attn::runtime::model::ModelConfig;

/// Model TOML keys a sweep may not vary: the vocabulary follows the tokenizer, the spec is
/// varied key by key, and a sweep trains from random weights.
const FIXED_KEYS: &[&str] = &["vocab", "attention", "weights"];

/// Whether `key` is a model TOML key a sweep varies.
fn is_toml_key(key: &str) -> bool {
    research::KEYS.contains(&key) && !FIXED_KEYS.contains(&key)
}

/// Most combinations one sweep trains.
pub const MAX_VARIANTS: usize = 256;

/// One `--vary`: a key and the values it takes, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct Axis {
    pub key: String,
    pub values: Vec<String>,
}

/// One combination: a value for every axis.
#[derive(Clone, Debug, PartialEq)]
pub struct Variant {
    /// Its place in the grid (0 first), which names its folder.
    pub index: usize,
    pub settings: Vec<(String, String)>,
}

impl Variant {
    /// `key=value` per axis, space-separated (`base` for a grid without axes).
    pub fn name(&self) -> String {
        if self.settings.is_empty() {
            return "base".into();
        }
        let parts: Vec<String> = self
            .settings
            .iter()
            .map(|(k, v)| format!("{k}={}", v.split_whitespace().collect::<String>()))
            .collect();
        parts.join(" ")
    }

    /// Its folder under `runs/`: the grid index and the name, with every character other than
    /// letters, digits, `.`, `=`, `-` and `_` made `_` (at most 80 of them).
    pub fn folder(&self) -> String {
        let name: String = self
            .name()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "._=-".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .take(80)
            .collect();
        format!("{:03}-{name}", self.index)
    }
}

/// Every key `--vary` takes, TOML keys first.
pub fn allowed_keys() -> Vec<&'static str> {
    research::KEYS
        .iter()
        .copied()
        .filter(|k| is_toml_key(k))
        .chain(attn::dsl::settable_keys())
        .collect()
}

/// Whether `key` is a spec key for one attention kind, `KIND.KEY`: the kind's name and the key.
fn kind_key(key: &str) -> Option<(&str, &str)> {
    let (kind, spec_key) = key.split_once('.')?;
    let named = !kind.is_empty() && kind.chars().all(|c| c.is_alphanumeric() || c == '_');
    (named && attn::dsl::settable_keys().any(|k| k == spec_key)).then_some((kind, spec_key))
}

/// The axes of the `--vary` arguments, checked: `KEY=V1,V2,...` with a known key (or
/// `KIND.KEY` for a spec key of one attention kind), each key once, no empty or repeated value.
pub fn axes(varies: &[String]) -> Result<Vec<Axis>, String> {
    let mut axes: Vec<Axis> = Vec::new();
    for text in varies {
        let bad = |m: String| format!("error: --vary {text:?}: {m}");
        let Some((key, list)) = text.split_once('=') else {
            return Err(bad("expected KEY=V1,V2,...".into()));
        };
        let key = key.trim();
        if !allowed_keys().contains(&key) && kind_key(key).is_none() {
            return Err(bad(format!(
                "`{key}` is not a key a sweep varies; allowed: {}, or KIND.KEY for a spec key \
                 of one attention kind (local.mask)",
                allowed_keys().join(", ")
            )));
        }
        if axes.iter().any(|a| a.key == key) {
            return Err(bad(format!(
                "`{key}` is varied twice; give all its values in one --vary"
            )));
        }
        let values = split_values(list);
        if let Some(empty) = values.iter().position(|v| v.is_empty()) {
            return Err(bad(format!("value {} of `{key}` is empty", empty + 1)));
        }
        for (i, v) in values.iter().enumerate() {
            if values[..i].contains(v) {
                return Err(bad(format!("`{key}` lists the value `{v}` twice")));
            }
        }
        axes.push(Axis {
            key: key.to_string(),
            values,
        });
    }
    Ok(axes)
}

/// The values of a list, split at the commas outside brackets and outside a closure's
/// parameters (`|s, b, h, q, k| ...`), trimmed.
fn split_values(list: &str) -> Vec<String> {
    let mut values = Vec::new();
    let (mut depth, mut current, mut in_params) = (0usize, String::new(), false);
    for c in list.chars() {
        match c {
            '|' if current.trim().is_empty() || in_params => in_params = !in_params,
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 && !in_params => {
                values.push(current.trim().to_string());
                current.clear();
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    values.push(current.trim().to_string());
    values
}

/// The product of the axes, the first axis slowest; refused past [`MAX_VARIANTS`].
pub fn variants(axes: &[Axis]) -> Result<Vec<Variant>, String> {
    let count = axes
        .iter()
        .try_fold(1usize, |n, a| n.checked_mul(a.values.len()))
        .filter(|&n| n <= MAX_VARIANTS)
        .ok_or_else(|| {
            format!(
                "error: --vary: the grid has more than {MAX_VARIANTS} combinations; allowed: \
                 at most {MAX_VARIANTS}"
            )
        })?;
    Ok((0..count)
        .map(|index| {
            let mut rest = index;
            let mut settings = vec![(String::new(), String::new()); axes.len()];
            for (i, axis) in axes.iter().enumerate().rev() {
                let n = axis.values.len();
                settings[i] = (axis.key.clone(), axis.values[rest % n].clone());
                rest /= n;
            }
            Variant { index, settings }
        })
        .collect())
}

/// The base model: its TOML table, which must not name trained weights.
pub fn base(text: &str) -> Result<toml::Table, String> {
    research::config_from_toml(text).map_err(|e| format!("error: --base: {e}"))?;
    let table: toml::Table = text.parse().map_err(|e| format!("error: --base: {e}"))?;
    if table.contains_key("weights") {
        return Err(
            "error: --base: it names trained `weights`; a sweep trains every variant from \
             random weights, so remove the key"
                .into(),
        );
    }
    Ok(table)
}

/// The attention kinds of a base TOML: their names (none for a single spec) and specs.
fn kinds(table: &toml::Table) -> Vec<(Option<String>, String)> {
    let text = |v: &toml::Value| v.as_str().unwrap_or_default().to_string();
    match table.get("attention") {
        Some(toml::Value::Table(kinds)) => kinds
            .iter()
            .map(|(name, v)| (Some(name.clone()), text(v)))
            .collect(),
        other => vec![(None, other.map(text).unwrap_or_default())],
    }
}

/// Refuses an axis `KIND.KEY` whose kind the base does not have.
pub fn check_kinds(base: &toml::Table, axes: &[Axis]) -> Result<(), String> {
    let names: Vec<String> = kinds(base).into_iter().filter_map(|(n, _)| n).collect();
    for axis in axes {
        if let Some((kind, _)) = kind_key(&axis.key)
            && !names.iter().any(|n| n == kind)
        {
            let has = if names.is_empty() {
                "one attention spec and no named kinds".to_string()
            } else {
                format!("the kinds {}", names.join(", "))
            };
            return Err(format!(
                "error: --vary {}: the base model has no attention kind `{kind}`; it has {has}",
                axis.key
            ));
        }
    }
    Ok(())
}

/// The base with `variant`'s settings applied, as a checked config and its TOML text; an
/// error says which setting the config refused and why.
pub fn apply(base: &toml::Table, variant: &Variant) -> Result<(ModelConfig, String), String> {
    let mut table = base.clone();
    // One spec, or a table of named kinds: a spec key applies to every kind, `KIND.KEY` to one.
    let mut specs = kinds(&table);
    for (key, value) in &variant.settings {
        if is_toml_key(key) {
            match toml_value(value) {
                None => table.remove(key),
                Some(v) => table.insert(key.clone(), v),
            };
            continue;
        }
        let (only, spec_key) = match kind_key(key) {
            Some((kind, spec_key)) => (Some(kind), spec_key),
            None => (None, key.as_str()),
        };
        for (name, spec) in &mut specs {
            if only.is_none() || name.as_deref() == only {
                *spec = attn::dsl::set_key(spec, spec_key, value).map_err(|e| e.to_string())?;
            }
        }
    }
    // The edited text is the sweep's, not the user's: say what it is rather than where.
    for (_, spec) in &specs {
        if let Err(e) = attn::dsl::parse_str(spec) {
            let messages: Vec<String> = e.0.into_iter().map(|e| e.message).collect();
            return Err(format!("attention \"{spec}\": {}", messages.join("; ")));
        }
    }
    let attention = match specs.as_slice() {
        [(None, spec)] => toml::Value::String(spec.clone()),
        _ => toml::Value::Table(
            specs
                .into_iter()
                .map(|(name, spec)| (name.unwrap_or_default(), toml::Value::String(spec)))
                .collect(),
        ),
    };
    table.insert("attention".into(), attention);
    let text = table.to_string();
    let config = research::config_from_toml(&text).map_err(|e| e.to_string())?;
    Ok((config, text))
}

/// A value as TOML: `none` removes the key (`moe=none`, a dense baseline); a TOML value reads
/// as itself (`4`, `1e-5`, `true`, `["local", "global"]`, `{experts = 4, top_k = 2}`); any
/// other text is a string (`gelu`).
fn toml_value(text: &str) -> Option<toml::Value> {
    if text == "none" {
        return None;
    }
    let parsed = format!("v = {text}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"));
    Some(parsed.unwrap_or_else(|| toml::Value::String(text.to_string())))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "vocab = 256\nhidden = 64\nlayers = 2\n\
        attention = \"heads = 4, kv_heads = 4, head_dim = 16, mask = causal, position = rope\"\n";

    fn vary(args: &[&str]) -> Result<Vec<Axis>, String> {
        axes(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn values_split_outside_brackets_and_closure_parameters() {
        assert_eq!(
            split_values("causal, sliding_window(64)"),
            ["causal", "sliding_window(64)"]
        );
        assert_eq!(
            split_values("rope(base = 500000.0, dim = 8),alibi"),
            ["rope(base = 500000.0, dim = 8)", "alibi"]
        );
        assert_eq!(
            split_values("|s, b, h, q, k| s * 0.5, |s, b, h, q, k| s"),
            ["|s, b, h, q, k| s * 0.5", "|s, b, h, q, k| s"]
        );
    }

    #[test]
    fn the_grid_is_the_product_with_the_first_axis_slowest() {
        let grid = variants(&vary(&["kv_heads=1,4", "layers=1,2,3"]).unwrap()).unwrap();
        assert_eq!(grid.len(), 6);
        assert_eq!(grid[0].name(), "kv_heads=1 layers=1");
        assert_eq!(grid[1].name(), "kv_heads=1 layers=2");
        assert_eq!(grid[5].name(), "kv_heads=4 layers=3");
        assert_eq!(grid[5].folder(), "005-kv_heads=4_layers=3");
        assert_eq!(variants(&[]).unwrap()[0].name(), "base");
    }

    #[test]
    fn settings_reach_the_toml_and_the_spec() {
        let base = base(BASE).unwrap();
        let axes = vary(&[
            "mlp=gelu",
            "kv_heads=2",
            "mask=sliding_window(8)",
            "tie_embeddings=false",
        ])
        .unwrap();
        let (config, _) = apply(&base, &variants(&axes).unwrap()[0]).unwrap();
        assert_eq!(config.mlp, attn::runtime::model::MlpKind::Gelu);
        assert!(!config.tie_embeddings);
        assert_eq!(config.layers, 2);
        assert_eq!(
            config.attention,
            vec![
                "heads = 4, kv_heads = 2, head_dim = 16, mask = sliding_window(8), position = rope"
                    .parse()
                    .unwrap()
            ]
        );
        // The MLP width follows the varied width when the base leaves it to the default.
        let (config, _) = apply(
            &base,
            &variants(&vary(&["hidden=128"]).unwrap()).unwrap()[0],
        )
        .unwrap();
        assert_eq!(config.intermediate, 384);
    }

    #[test]
    fn pattern_moe_none_and_one_kinds_keys_reach_the_model() {
        let hybrid = "vocab = 256\nhidden = 64\nlayers = 3\npattern = [\"local\", \"global\"]\n\
            [attention]\nlocal = \"heads = 4, head_dim = 16, mask = sliding_window(8)\"\n\
            global = \"heads = 4, head_dim = 16, mask = causal, softcap = 30.0\"\n";
        let base = base(hybrid).unwrap();
        let grid = |varies: &[&str]| {
            let axes = vary(varies).unwrap();
            check_kinds(&base, &axes).map(|()| variants(&axes).unwrap())
        };
        // One kind's key changes that kind only.
        let v = grid(&["local.mask=sliding_window(4),causal"]).unwrap();
        let (c, toml) = apply(&base, &v[0]).unwrap();
        assert_eq!(c.attention[0].mask, attn::Mask::SlidingWindow { window: 4 });
        assert_eq!(
            c.attention[1].mask,
            attn::Mask::Causal(attn::dsl::CausalAlign::BottomRight)
        );
        assert!(
            toml.contains("local = ") && toml.contains("global = "),
            "{toml}"
        );
        let e = grid(&["nowhere.mask=causal"]).unwrap_err();
        assert!(
            e.contains("no attention kind `nowhere`; it has the kinds global, local"),
            "{e}"
        );
        // softcap = none: the baseline on the softcap axis.
        let v = grid(&["global.softcap=none,50.0"]).unwrap();
        assert_eq!(apply(&base, &v[0]).unwrap().0.attention[1].softcap, None);
        assert_eq!(
            apply(&base, &v[1]).unwrap().0.attention[1].softcap,
            Some(50.0)
        );
        // A pattern and a [moe] table, or none.
        let v = grid(&[
            "pattern=[\"global\", \"local\"],[\"local\", \"local\", \"global\"]",
            "moe={experts = 4, top_k = 2},none",
        ])
        .unwrap();
        assert_eq!(v.len(), 4);
        let (c, _) = apply(&base, &v[0]).unwrap();
        assert_eq!(c.pattern, [0, 1]);
        assert_eq!(
            c.attention[0].softcap,
            Some(30.0),
            "kinds numbered as the pattern names them"
        );
        assert_eq!(c.moe.as_ref().map(|m| (m.experts, m.top_k)), Some((4, 2)));
        let (c, _) = apply(&base, &v[3]).unwrap();
        assert_eq!((c.pattern.clone(), c.moe.is_none()), (vec![0, 0, 1], true));
    }

    proptest::proptest! {
        /// Any text after any key is a variant or an error, never a panic.
        #[test]
        fn any_value_is_applied_or_refused(key in 0usize..19, value in "\\PC{0,40}") {
            let keys = allowed_keys();
            let key = keys[key % keys.len()];
            if let Ok(axes) = axes(&[format!("{key}={value}")]) {
                let base = base(BASE).unwrap();
                for v in variants(&axes).unwrap() {
                    let _ = apply(&base, &v);
                }
            }
        }
    }

    #[test]
    fn deep_or_huge_values_are_refused() {
        let base = base(BASE).unwrap();
        for value in [
            "(".repeat(100_000),
            "[".repeat(100_000),
            "9".repeat(100_000),
        ] {
            for key in ["softcap", "position", "hidden"] {
                let axes = axes(&[format!("{key}={value}")]).unwrap();
                assert!(apply(&base, &variants(&axes).unwrap()[0]).is_err(), "{key}");
            }
        }
    }

    #[test]
    fn bad_axes_and_combinations_are_errors_that_say_why() {
        let e = vary(&["heads_kv=1,2"]).unwrap_err();
        assert!(
            e.contains("allowed: hidden, layers") && e.contains("kv_heads"),
            "{e}"
        );
        let e = vary(&["layers=1", "layers=2"]).unwrap_err();
        assert!(e.contains("varied twice"), "{e}");
        assert!(vary(&["layers=1,,2"]).unwrap_err().contains("empty"));
        assert!(vary(&["layers=1,1"]).unwrap_err().contains("twice"));
        assert!(vary(&["layers"]).unwrap_err().contains("KEY=V1,V2"));
        let e = vary(&["vocab=512"]).unwrap_err();
        assert!(e.contains("not a key"), "{e}");
        let many = vary(&[
            "layers=1,2,3,4,5,6,7,8,9",
            "hidden=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29",
        ])
        .unwrap();
        assert!(variants(&many).unwrap_err().contains("256"));
        let base = base(BASE).unwrap();
        let grid = variants(&vary(&["kv_heads=3", "position=alibi"]).unwrap()).unwrap();
        let e = apply(&base, &grid[0]).unwrap_err();
        assert!(e.contains("not a multiple of kv_heads (3)"), "{e}");
        assert!(e.contains("position = alibi"), "the whole edited spec: {e}");
        // Settings are applied together: heads = 2 is only valid once kv_heads follows.
        let grid = variants(&vary(&["heads=2", "kv_heads=2"]).unwrap()).unwrap();
        assert_eq!(apply(&base, &grid[0]).unwrap().0.attention[0].heads, 2);
        let grid = variants(&vary(&["layers=-1"]).unwrap()).unwrap();
        assert!(apply(&base, &grid[0]).unwrap_err().contains("layers"));
        let weights = format!("{BASE}weights = \"model.safetensors\"\n");
        assert!(super::base(&weights).unwrap_err().contains("weights"));
    }
}
