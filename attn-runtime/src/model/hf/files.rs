//! A checkpoint's files: `config.json` read once and parsed, and the weights in one\n//! `*.safetensors` file or in shards listed by `model.safetensors.index.json`.

use crate::error::RuntimeError;
use crate::files::{MAX_CONFIG_BYTES, read_text};
use crate::io::read_safetensors;
use crate::model::json_fields::{Fields, bad};
use crate::tensor::Tensor;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A checkpoint's parsed `config.json`.
pub(super) struct Config {
    pub(super) path: PathBuf,
    json: Value,
}

impl Config {
    /// Reads and parses `dir/config.json` (a regular file of at most
    /// [`MAX_CONFIG_BYTES`](crate::files::MAX_CONFIG_BYTES)).
    pub(super) fn read(dir: &Path) -> Result<Config, RuntimeError> {
        let path = dir.join("config.json");
        let text = read_text(&path, MAX_CONFIG_BYTES, "config.json")?;
        let json =
            serde_json::from_str(&text).map_err(|e| bad(&path, format!("not valid JSON: {e}")))?;
        Ok(Config { path, json })
    }

    pub(super) fn fields(&self) -> Result<Fields<'_>, RuntimeError> {
        Fields::top(&self.path, &self.json)
    }
}

/// The weight files of a checkpoint and which tensor lives in which.
pub(super) struct Files {
    by_name: HashMap<String, PathBuf>,
    single: Option<PathBuf>,
}

impl Files {
    pub(super) fn of(dir: &Path) -> Result<Files, RuntimeError> {
        let index = dir.join("model.safetensors.index.json");
        // Present even as a link to nothing (a Hugging Face cache whose blob is gone): then it
        // is read, and its error names it, rather than another file being used instead.
        if std::fs::symlink_metadata(&index).is_ok() {
            let text = read_text(&index, MAX_CONFIG_BYTES, "the shard index")?;
            let json: Value = serde_json::from_str(&text)
                .map_err(|e| bad(&index, format!("not valid JSON: {e}")))?;
            let map = json
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| bad(&index, "`weight_map` is missing"))?;
            let by_name = map
                .iter()
                .map(|(name, file)| {
                    let file = file.as_str().ok_or_else(|| {
                        bad(
                            &index,
                            format!("`weight_map.{name}` is not a string; expected a file name"),
                        )
                    })?;
                    shard_path(dir, file)
                        .ok_or_else(|| {
                            bad(
                                &index,
                                format!(
                                    "`weight_map.{name}` = {file:?} is not a file name in the \
                                 checkpoint's directory; allowed: a plain name such as \
                                 model-00001-of-00002.safetensors"
                                ),
                            )
                        })
                        .map(|path| (name.clone(), path))
                })
                .collect::<Result<_, _>>()?;
            return Ok(Files {
                by_name,
                single: None,
            });
        }
        let single = dir.join("model.safetensors");
        if !single.exists() {
            return Err(bad(
                dir,
                "no model.safetensors or model.safetensors.index.json in this directory",
            ));
        }
        Ok(Files {
            by_name: HashMap::new(),
            single: Some(single),
        })
    }

    /// Whether the checkpoint holds a tensor `name` (the single file's header is read).
    pub(super) fn holds(&self, name: &str) -> Result<bool, RuntimeError> {
        match &self.single {
            Some(file) => Ok(crate::io::tensor_names(file)?.iter().any(|n| n == name)),
            None => Ok(self.by_name.contains_key(name)),
        }
    }

    /// Reads the named tensors as stored, in order.
    pub(super) fn read_raw(
        &self,
        names: &[String],
    ) -> Result<Vec<crate::io::RawTensor>, RuntimeError> {
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            out.extend(crate::io::read_raw(&self.file_of(name)?, &[name.as_str()])?);
        }
        Ok(out)
    }

    /// The file holding tensor `name`.
    fn file_of(&self, name: &str) -> Result<PathBuf, RuntimeError> {
        match &self.single {
            Some(f) => Ok(f.clone()),
            None => self.by_name.get(name).cloned().ok_or_else(|| {
                RuntimeError::Data(format!(
                    "tensor `{name}` is not in the checkpoint's weight map"
                ))
            }),
        }
    }

    /// Reads the named tensors, file by file.
    pub(super) fn read(&self, names: &[String]) -> Result<HashMap<String, Tensor>, RuntimeError> {
        let mut by_file: HashMap<&Path, Vec<&str>> = HashMap::new();
        for name in names {
            let file = match &self.single {
                Some(f) => f.as_path(),
                None => self
                    .by_name
                    .get(name)
                    .map(PathBuf::as_path)
                    .ok_or_else(|| {
                        RuntimeError::Data(format!(
                            "tensor `{name}` is not in the checkpoint's weight map"
                        ))
                    })?,
            };
            by_file.entry(file).or_default().push(name);
        }
        let mut out = HashMap::new();
        for (file, names) in by_file {
            for (name, t) in names.iter().zip(read_safetensors(file, &names)?) {
                out.insert(name.to_string(), t);
            }
        }
        Ok(out)
    }
}

/// `dir/file` when `file` is one plain file name (no directories, no `..`, not absolute): a shard
/// index names files beside it, never elsewhere.
fn shard_path(dir: &Path, file: &str) -> Option<PathBuf> {
    let mut parts = Path::new(file).components();
    match (parts.next(), parts.next()) {
        (Some(std::path::Component::Normal(name)), None) => Some(dir.join(name)),
        _ => None,
    }
}
