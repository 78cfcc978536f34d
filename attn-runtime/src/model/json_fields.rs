//! Typed lookups in a JSON object (a checkpoint's `config.json`, its RoPE parameters).
//!
//! A key that is absent or `null` takes its default; a key that is present with the wrong JSON
//! type is an error naming the key, the type found and the type expected, never a silent
//! default (a `"rope_theta": "500000"` must not run as 10000).

use crate::error::RuntimeError;
use crate::model::config::MAX_LAYERS;
use serde_json::{Map, Value};
use std::path::Path;

/// The fields of one JSON object in a file; `scope` prefixes key names in errors
/// (`rope_parameters.` for the nested RoPE object).
#[derive(Clone, Copy)]
pub(crate) struct Fields<'a> {
    path: &'a Path,
    scope: &'a str,
    map: &'a Map<String, Value>,
}

/// The JSON type of `v`, with the value when it is short, for an error.
fn found(v: &Value) -> String {
    let kind = match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    let text = v.to_string();
    if matches!(v, Value::Array(_) | Value::Object(_)) || text.len() > 40 {
        kind.to_string()
    } else {
        format!("{kind} ({text})")
    }
}

impl<'a> Fields<'a> {
    /// The top-level object of a parsed file; anything else is an error.
    pub(crate) fn top(path: &'a Path, json: &'a Value) -> Result<Fields<'a>, RuntimeError> {
        match json {
            Value::Object(map) => Ok(Fields {
                path,
                scope: "",
                map,
            }),
            other => Err(bad(
                path,
                format!("is {}; expected a JSON object", found(other)),
            )),
        }
    }

    /// The nested object at `key` with `scope` naming it in errors; `None` when absent.
    pub(crate) fn object(
        &self,
        key: &str,
        scope: &'a str,
    ) -> Result<Option<Fields<'a>>, RuntimeError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Fields {
                path: self.path,
                scope,
                map,
            })),
            Some(other) => Err(self.wrong(key, other, "an object")),
        }
    }

    /// The file these fields come from.
    pub(crate) fn path(&self) -> &'a Path {
        self.path
    }

    /// Whether `key` is there at all (`null` included).
    pub(crate) fn has(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    /// The value at `key`, `None` when absent or `null`.
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    /// The error for `key` holding `v` where `expected` was wanted.
    fn wrong(&self, key: &str, v: &Value, expected: &str) -> RuntimeError {
        bad(
            self.path,
            format!("`{}{key}` is {}; expected {expected}", self.scope, found(v)),
        )
    }

    /// A whole number of at most `u32::MAX` (every count and width of a config; larger ones are
    /// refused here, so sums of two cannot overflow); `None` when absent.
    pub(crate) fn uint_opt(&self, key: &str) -> Result<Option<usize>, RuntimeError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let n = v
            .as_u64()
            .ok_or_else(|| self.wrong(key, v, "a whole number"))?;
        u32::try_from(n).map(|n| Some(n as usize)).map_err(|_| {
            bad(
                self.path,
                format!(
                    "`{}{key}` = {n} is out of range; allowed: at most {}",
                    self.scope,
                    u32::MAX
                ),
            )
        })
    }

    /// [`Fields::uint_opt`] for a key that must be there.
    pub(crate) fn uint(&self, key: &str) -> Result<usize, RuntimeError> {
        self.uint_opt(key)?
            .ok_or_else(|| bad(self.path, format!("`{}{key}` is missing", self.scope)))
    }

    /// A whole number under `key`, or under its older name `alias` where `key` is absent
    /// (bloom's `n_layer` for `num_hidden_layers`); an error naming both when neither is there.
    pub(crate) fn uint_or_alias(&self, key: &str, alias: &str) -> Result<usize, RuntimeError> {
        match self.uint_opt(key)? {
            Some(n) => Ok(n),
            None => self.uint_opt(alias)?.ok_or_else(|| {
                bad(
                    self.path,
                    format!(
                        "`{}{key}` (or `{}{alias}`) is missing",
                        self.scope, self.scope
                    ),
                )
            }),
        }
    }

    /// A number; `None` when absent.
    pub(crate) fn float_opt(&self, key: &str) -> Result<Option<f64>, RuntimeError> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.wrong(key, v, "a number")))
            .transpose()
    }

    /// A number, `default` when absent.
    pub(crate) fn float_or(&self, key: &str, default: f64) -> Result<f64, RuntimeError> {
        Ok(self.float_opt(key)?.unwrap_or(default))
    }

    /// A boolean, false when absent.
    pub(crate) fn flag(&self, key: &str) -> Result<bool, RuntimeError> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.wrong(key, v, "true or false"))
            })
            .transpose()
            .map(|b| b.unwrap_or(false))
    }

    /// A string; `None` when absent.
    pub(crate) fn str_opt(&self, key: &str) -> Result<Option<&'a str>, RuntimeError> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| self.wrong(key, v, "a string")))
            .transpose()
    }
}

impl<'a> Fields<'a> {
    /// An array of exactly `len` items, one per `per` (a layer, a rotated pair; for errors),
    /// each read by `item`; `None` when absent.
    pub(crate) fn list_opt<T>(
        &self,
        key: &str,
        (len, per): (usize, &str),
        item: impl Fn(&'a Value) -> Option<T>,
        expected: &str,
    ) -> Result<Option<Vec<T>>, RuntimeError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let Value::Array(items) = v else {
            return Err(self.wrong(key, v, &format!("an array of {len} {expected}")));
        };
        if items.len() != len {
            return Err(bad(
                self.path,
                format!(
                    "`{}{key}` has {} entries; expected one per {per}, {len}",
                    self.scope,
                    items.len()
                ),
            ));
        }
        items
            .iter()
            .enumerate()
            .map(|(i, x)| {
                item(x).ok_or_else(|| {
                    bad(
                        self.path,
                        format!(
                            "`{}{key}[{i}]` is {}; expected {expected}",
                            self.scope,
                            found(x)
                        ),
                    )
                })
            })
            .collect::<Result<Vec<T>, _>>()
            .map(Some)
    }

    /// A number that takes `default` when the key is absent (transformers' default) and none
    /// when it is `null`.
    pub(crate) fn float_or_absent(
        &self,
        key: &str,
        default: Option<f64>,
    ) -> Result<Option<f64>, RuntimeError> {
        if self.has(key) {
            self.float_opt(key)
        } else {
            Ok(default)
        }
    }

    /// A list of layer indices (`[]` when absent; at most [`MAX_LAYERS`] of them).
    pub(crate) fn layer_list(&self, key: &str) -> Result<Vec<usize>, RuntimeError> {
        let Some(v) = self.get(key) else {
            return Ok(Vec::new());
        };
        let items = v
            .as_array()
            .filter(|a| a.len() <= MAX_LAYERS)
            .ok_or_else(|| {
                bad(
                    self.path,
                    format!("`{key}` must be a list of at most {MAX_LAYERS} layer indices"),
                )
            })?;
        items
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_u64().map(|x| x as usize).ok_or_else(|| {
                    bad(
                        self.path,
                        format!("`{key}[{i}]` is {x}; expected a layer index"),
                    )
                })
            })
            .collect()
    }
}

/// An error about the file at `path`.
pub(crate) fn bad(path: &Path, message: impl Into<String>) -> RuntimeError {
    RuntimeError::Io {
        path: path.display().to_string(),
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(json: &str, check: impl FnOnce(Fields) -> Result<(), RuntimeError>) -> String {
        let value: Value = serde_json::from_str(json).unwrap();
        let fields = Fields::top(Path::new("config.json"), &value).unwrap();
        check(fields).map_or_else(|e| e.to_string(), |()| "ok".to_string())
    }

    #[test]
    fn absent_and_null_keys_take_defaults() {
        let r = with(r#"{"a": null}"#, |f| {
            assert_eq!(f.float_or("a", 2.5)?, 2.5);
            assert_eq!(f.float_or("b", 3.0)?, 3.0);
            assert!(!f.flag("a")?);
            assert_eq!(f.uint_opt("b")?, None);
            assert_eq!(f.str_opt("a")?, None);
            Ok(())
        });
        assert_eq!(r, "ok");
    }

    #[test]
    fn present_keys_of_the_wrong_type_are_errors_naming_key_and_types() {
        let e = with(r#"{"rope_theta": "500000"}"#, |f| {
            f.float_or("rope_theta", 1e4).map(drop)
        });
        assert!(
            e.contains("`rope_theta` is a string (\"500000\"); expected a number"),
            "{e}"
        );
        let e = with(r#"{"w": "2"}"#, |f| f.uint_opt("w").map(drop));
        assert!(e.contains("`w` is a string"), "{e}");
        assert!(e.contains("expected a whole number"), "{e}");
        let e = with(r#"{"w": 2.5}"#, |f| f.uint("w").map(drop));
        assert!(e.contains("a number (2.5)"), "{e}");
        let e = with(r#"{"t": 1}"#, |f| f.flag("t").map(drop));
        assert!(e.contains("expected true or false"), "{e}");
        let e = with(r#"{"r": "x"}"#, |f| f.object("r", "r.").map(drop));
        assert!(e.contains("`r` is a string"), "{e}");
        let e = with(r#"{"r": {"factor": [8]}}"#, |f| {
            f.object("r", "r.")?.unwrap().float_opt("factor").map(drop)
        });
        assert!(e.contains("`r.factor` is an array"), "{e}");
        let e = with(r#"{"m": 5}"#, |f| f.str_opt("m").map(drop));
        assert!(e.contains("`m` is a number (5); expected a string"), "{e}");
    }

    #[test]
    fn a_file_that_is_not_an_object_is_refused() {
        let value: Value = serde_json::from_str("[1]").unwrap();
        let e = Fields::top(Path::new("c.json"), &value)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("is an array; expected a JSON object"), "{e}");
    }
}
