//! `attnc` against hostile paths and settings: a kernel cache pointed at someone else's files,
//! special files (FIFOs, devices, directories) at every path argument, outputs over inputs, and
//! limits the process runs under. Each must end in a clear error (exit 2) or a correct result,
//! never a hang, a crash or a lost file.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn attnc_cmd(args: &[&str], cache: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_attnc"));
    command
        .args(args)
        .env("ATTN_CACHE_DIR", cache)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Runs `command`, killing it (and failing the test) if it takes more than a minute: a read
/// that waits on a FIFO would otherwise hang the suite.
fn finish(mut command: Command, case: &str) -> Output {
    let mut child = command.spawn().expect("attnc starts");
    let started = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if started.elapsed() > Duration::from_secs(60) {
            child.kill().ok();
            panic!("{case}: attnc was still running after a minute");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn attnc(args: &[&str], cache: &Path) -> Output {
    finish(attnc_cmd(args, cache), &args.join(" "))
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A fresh directory of this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("attnc-hostile-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(path)
}

fn mkfifo(path: &Path) -> bool {
    Command::new("mkfifo")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success())
}

/// Every file under `dir` (not following links) with its bytes (`None` for what is not a
/// regular file), sorted: what must be unchanged.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Option<Vec<u8>>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let entry = entry.unwrap();
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                stack.push(entry.path());
            }
            let bytes = kind.is_file().then(|| std::fs::read(entry.path()).unwrap());
            out.push((entry.path(), bytes));
        }
    }
    out.sort();
    out
}

/// Fills `dir` with what a user keeps: a checkpoint's JSON files, a folder named like a JSON
/// file, a FIFO and a link to a device, each with a `.json` name.
fn fill_with_foreign_files(dir: &Path) {
    let checkpoint = fixture("hf-tiny/llama_tokenizer");
    for file in ["config.json", "tokenizer.json", "generation_config.json"] {
        std::fs::copy(checkpoint.join(file), dir.join(file)).unwrap();
    }
    std::fs::write(dir.join("notes.json"), "{\"mine\": true}").unwrap();
    // Named as a cache entry would be, but not one.
    std::fs::write(
        dir.join("0123456789abcdef0123456789abcdef.json"),
        "{\"format\": 2, \"kernel\": \"mine\"}",
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("x.json")).unwrap();
    std::fs::write(dir.join("x.json").join("inside.json"), "{}").unwrap();
    std::fs::create_dir_all(dir.join("fedcba9876543210fedcba9876543210.json")).unwrap();
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero.json")).unwrap();
        std::os::unix::fs::symlink(dir.join("notes.json"), dir.join("link.json")).unwrap();
        mkfifo(&dir.join("pipe.json"));
    }
}

/// A cache entry as attnc writes one (format, fields, PTX hash), for kernel `name` on sm_80,
/// with `spec` recorded.
fn entry(name: &str, spec: &str) -> String {
    use attn::codegen::gpu::ir::target::{compiler_version, text_hash};
    let ptx = format!(".version 8.0\n.target sm_80\n.visible .entry {name}(\n)\n{{\n}}\n");
    serde_json::json!({
        "format": 2, "kernel": name, "target": "sm_80", "compiler": compiler_version(),
        "spec": spec, "ir": "kernel ir", "ptx_hash": text_hash(&ptx), "ptx": ptx,
    })
    .to_string()
}

/// `ATTN_CACHE_DIR` pointed at a checkpoint (or anything else of the user's): `cache list`
/// shows no kernels and `cache clear` removes nothing, whatever the files are called.
#[test]
fn the_kernel_cache_never_touches_files_it_did_not_write() {
    let dir = scratch("cache-foreign");
    fill_with_foreign_files(&dir);
    let before = snapshot(&dir);
    let list = attnc(&["cache", "list"], &dir);
    assert_eq!(list.status.code(), Some(0), "{}", stderr(&list));
    assert!(stdout(&list).contains("(0 entries)"), "{}", stdout(&list));
    let clear = attnc(&["cache", "clear"], &dir);
    assert_eq!(clear.status.code(), Some(0), "{}", stderr(&clear));
    assert!(
        stdout(&clear).contains("removed 0 kernels"),
        "{}",
        stdout(&clear)
    );
    assert_eq!(
        snapshot(&dir),
        before,
        "cache clear changed the user's files"
    );

    // The same foreign files inside the cache's own folder, beside one real entry: only the
    // entry goes.
    let own = dir.join("attn-kernels");
    std::fs::create_dir_all(&own).unwrap();
    fill_with_foreign_files(&own);
    let kept = snapshot(&dir);
    let real = own.join("00000000000000000000000000000001.json");
    std::fs::write(&real, entry("attention_forward", "heads = 1, head_dim = 8")).unwrap();
    let list = attnc(&["cache", "list"], &dir);
    assert!(stdout(&list).contains("(1 entries)"), "{}", stdout(&list));
    let clear = attnc(&["cache", "clear"], &dir);
    assert_eq!(clear.status.code(), Some(0), "{}", stderr(&clear));
    assert!(
        stdout(&clear).contains("removed 1 kernels") && stdout(&clear).contains("left"),
        "{}",
        stdout(&clear)
    );
    assert!(!real.exists());
    assert_eq!(
        snapshot(&dir),
        kept,
        "cache clear removed more than its entry"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Entry fields come from files: `cache list` prints them escaped, so no escape sequence or
/// line break of an entry reaches the terminal.
#[test]
fn cache_list_escapes_what_entries_hold() {
    let dir = scratch("cache-escape");
    let own = dir.join("attn-kernels");
    std::fs::create_dir_all(&own).unwrap();
    std::fs::write(
        own.join("00000000000000000000000000000002.json"),
        entry("attention_forward", "heads = 1\u{1b}[31m\nINJECTED\r\u{7}"),
    )
    .unwrap();
    let list = attnc(&["cache", "list"], &dir);
    assert_eq!(list.status.code(), Some(0), "{}", stderr(&list));
    let text = stdout(&list);
    assert!(text.contains("(1 entries)"), "{text}");
    assert!(
        !text.contains('\u{1b}') && !text.contains('\r') && !text.contains('\u{7}'),
        "{text:?}"
    );
    assert!(!text.lines().any(|l| l.starts_with("INJECTED")), "{text}");
    assert!(text.contains("\\u{1b}[31m\\nINJECTED"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A cache folder others may write is not used: its entries are not served or listed.
#[cfg(unix)]
#[test]
fn a_cache_folder_others_may_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch("cache-shared");
    let own = dir.join("attn-kernels");
    std::fs::create_dir_all(&own).unwrap();
    std::fs::set_permissions(&own, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::write(
        own.join("00000000000000000000000000000003.json"),
        entry("attention_forward", "x"),
    )
    .unwrap();
    let list = attnc(&["cache", "list"], &dir);
    assert_eq!(list.status.code(), Some(2));
    assert!(
        stderr(&list).contains("group or others may write it"),
        "{}",
        stderr(&list)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The special files every path argument is tried with: a directory, a FIFO (a read would wait
/// for a writer forever), a link to an endless device and a link to nothing.
fn special_files(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut out = vec![("a directory".to_string(), dir.join("folder"))];
    std::fs::create_dir_all(dir.join("folder")).unwrap();
    #[cfg(unix)]
    {
        if mkfifo(&dir.join("fifo")) {
            out.push(("a FIFO".into(), dir.join("fifo")));
        }
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero")).unwrap();
        out.push(("a link to /dev/zero".into(), dir.join("zero")));
        std::os::unix::fs::symlink(dir.join("nothing"), dir.join("dangling")).unwrap();
        out.push(("a dangling link".into(), dir.join("dangling")));
    }
    out
}

/// Every path attnc reads, given each special file: exit 2 with a message, at once.
#[test]
fn special_files_at_every_input_path_are_refused() {
    let dir = scratch("special-inputs");
    let cache = dir.join("cache");
    let out = dir.join("out.safetensors");
    let out = out.to_str().unwrap();
    let spec = "heads = 4, head_dim = 64, mask = causal, scale = 0.125";
    let input = fixture("attention/mha_causal_f32.safetensors");
    let input = input.to_str().unwrap();
    let model = fixture("hf-tiny/llama_tokenizer");
    let model = model.to_str().unwrap();
    for (what, path) in special_files(&dir) {
        let p = path.to_str().unwrap();
        let at = format!("@{p}");
        let cases: Vec<Vec<&str>> = vec![
            vec!["check", &at],
            vec!["explain", &at],
            vec!["run", "--spec", &at, "--input", input, "--output", out],
            vec!["run", "--spec", spec, "--input", p, "--output", out],
            vec!["grad", "--spec", spec, "--input", p, "--output", out],
            vec!["params", "--model", p],
            vec!["logits", "--model", p, "--tokens", "1,2", "--output", out],
            vec!["generate", "--model", p, "--prompt", "hi"],
            vec!["generate", "--model", p, "--tokens", "1"],
            vec!["generate", "--model", model, "--prompt-file", p],
        ];
        for args in cases {
            let case = format!("{what}: attnc {}", args.join(" "));
            let o = finish(attnc_cmd(&args, &cache), &case);
            assert_eq!(o.status.code(), Some(2), "{case}: {}", stderr(&o));
            assert!(stderr(&o).starts_with("error"), "{case}: {}", stderr(&o));
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A checkpoint whose files are special files: config.json, the shard index, the weights and
/// tokenizer.json each replaced in turn.
#[test]
fn special_files_inside_a_checkpoint_are_refused() {
    let dir = scratch("special-checkpoint");
    let source = fixture("hf-tiny/llama_tokenizer");
    let specials = special_files(&dir);
    for file in [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ] {
        for (what, special) in &specials {
            let checkpoint = dir.join("checkpoint");
            std::fs::remove_dir_all(&checkpoint).ok();
            std::fs::create_dir_all(&checkpoint).unwrap();
            for f in ["config.json", "model.safetensors", "tokenizer.json"] {
                std::fs::copy(source.join(f), checkpoint.join(f)).unwrap();
            }
            std::fs::remove_file(checkpoint.join(file)).ok();
            #[cfg(unix)]
            std::os::unix::fs::symlink(special, checkpoint.join(file)).unwrap();
            let model = checkpoint.to_str().unwrap();
            let case = format!("{file} as {what}");
            let o = attnc(
                &[
                    "generate",
                    "--model",
                    model,
                    "--prompt",
                    "hi",
                    "--max-new-tokens",
                    "2",
                ],
                &dir.join("cache"),
            );
            assert_eq!(o.status.code(), Some(2), "{case}: {}", stderr(&o));
            assert!(stderr(&o).contains(file), "{case}: {}", stderr(&o));
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Outputs: never into a special file, never over the command's own input.
#[test]
fn outputs_over_inputs_or_into_special_files_are_refused() {
    let dir = scratch("outputs");
    let cache = dir.join("cache");
    let input = dir.join("in.safetensors");
    std::fs::copy(fixture("attention/mha_causal_f32.safetensors"), &input).unwrap();
    let original = std::fs::read(&input).unwrap();
    let spec = "heads = 4, head_dim = 64, mask = causal, scale = 0.125";
    let i = input.to_str().unwrap();
    #[cfg(unix)]
    let link = {
        let link = dir.join("link.safetensors");
        std::os::unix::fs::symlink(&input, &link).unwrap();
        link
    };
    let mut same: Vec<&str> = vec![i];
    #[cfg(unix)]
    same.push(link.to_str().unwrap());
    for output in same {
        for command in ["run", "grad"] {
            let o = attnc(
                &[command, "--spec", spec, "--input", i, "--output", output],
                &cache,
            );
            assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
            assert!(stderr(&o).contains("is the input"), "{}", stderr(&o));
        }
    }
    assert_eq!(
        std::fs::read(&input).unwrap(),
        original,
        "the input was overwritten"
    );
    let toml = dir.join("model.toml");
    std::fs::write(
        &toml,
        "vocab = 32\nhidden = 16\nlayers = 1\nattention = \"heads = 2, head_dim = 8\"\n",
    )
    .unwrap();
    let t = toml.to_str().unwrap();
    let o = attnc(
        &["logits", "--model", t, "--tokens", "1,2", "--output", t],
        &cache,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    for (what, special) in special_files(&dir) {
        if what.contains("dangling") {
            continue; // Writing through a link to nothing makes a file: allowed.
        }
        let s = special.to_str().unwrap();
        let o = attnc(
            &["run", "--spec", spec, "--input", i, "--output", s],
            &cache,
        );
        assert_eq!(o.status.code(), Some(2), "{what}: {}", stderr(&o));
        let o = attnc(&["emit", spec, "--emit", "gpu-ir", "-o", s], &cache);
        assert_eq!(o.status.code(), Some(2), "{what}: {}", stderr(&o));
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `emit --out-dir` with a target given twice writes each kernel once and says how many files.
#[test]
fn a_repeated_target_is_written_once() {
    let dir = scratch("emit-twice");
    let spec = "heads = 4, head_dim = 64, mask = causal";
    let once = dir.join("once");
    let twice = dir.join("twice");
    let run = |out: &Path, targets: &[&str]| {
        let mut args = vec![spec, "--emit", "gpu-ir", "--out-dir", out.to_str().unwrap()];
        for t in targets {
            args.extend(["--target", t]);
        }
        let mut all = vec!["emit"];
        all.extend(args);
        attnc(&all, &dir.join("cache"))
    };
    let a = run(&once, &["sm_80"]);
    let b = run(&twice, &["sm_80", "sm_80"]);
    assert_eq!(a.status.code(), Some(0), "{}", stderr(&a));
    assert_eq!(b.status.code(), Some(0), "{}", stderr(&b));
    let files = |d: &Path| std::fs::read_dir(d).unwrap().count() - 1; // less the manifest
    assert_eq!(files(&twice), files(&once));
    assert!(
        stderr(&b).contains(&format!("wrote {} kernels for 1 target", files(&twice))),
        "{}",
        stderr(&b)
    );
    let manifest = |d: &Path| std::fs::read_to_string(d.join("manifest.json")).unwrap();
    assert_eq!(manifest(&twice), manifest(&once));
    std::fs::remove_dir_all(&dir).ok();
}

/// A research model larger than the process may map (RLIMIT_AS, set by the shell's `ulimit
/// -v`) is refused with the limit named, not aborted by a failed allocation.
#[cfg(target_os = "linux")]
#[test]
fn a_model_past_the_address_space_limit_is_refused_not_aborted() {
    let dir = scratch("rlimit");
    let toml = dir.join("big.toml");
    // About 12 GiB of f32 weights.
    std::fs::write(
        &toml,
        "vocab = 32000\nhidden = 4096\nlayers = 16\nintermediate = 11008\n\
         attention = \"heads = 32, head_dim = 128\"\n",
    )
    .unwrap();
    let limited = |args: &str| {
        let script = format!(
            "ulimit -v 4000000 && exec {} {args} --model {}",
            env!("CARGO_BIN_EXE_attnc"),
            toml.display()
        );
        let mut command = Command::new("sh");
        command
            .args(["-c", &script])
            .env("ATTN_CACHE_DIR", dir.join("cache"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        finish(command, &format!("{args} under ulimit -v"))
    };
    let out = dir.join("logits.safetensors");
    let o = limited(&format!("logits --tokens 1 --output {}", out.display()));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("RLIMIT_AS"), "{}", stderr(&o));
    // Counting its parameters makes no weights: it answers under the same limit.
    let o = limited("params");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // 32000 x 4096 embedding and LM head (tied: once), 16 x (4 x 4096^2 attention + 3 x 4096
    // x 11008 MLP + 2 x 4096 norms), and the final norm.
    let total: u64 = 32000 * 4096 + 16 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 4096;
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(&format!("{:<10} {total:>14}", "total")),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `ATTN_DUMP_ASM` takes 0, 1, empty or nothing, like every other setting; a mistyped value is
/// an error under its own name, not a spec error.
#[test]
fn the_dump_asm_setting_is_parsed_like_the_others() {
    let dir = scratch("dump-asm");
    let out = dir.join("out.safetensors");
    let input = fixture("attention/mha_causal_f32.safetensors");
    let args = [
        "run",
        "--spec",
        "heads = 4, head_dim = 64, mask = causal, scale = 0.125",
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ];
    let with = |value: &str| {
        let mut command = attnc_cmd(&args, &dir.join("cache"));
        command.env("ATTN_DUMP_ASM", value);
        finish(command, value)
    };
    for off in ["0", ""] {
        let o = with(off);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        assert!(!stderr(&o).contains("== block"), "`{off}` dumped");
    }
    let on = with("1");
    assert_eq!(on.status.code(), Some(0), "{}", stderr(&on));
    assert!(stderr(&on).contains("== block"), "{}", stderr(&on));
    let bad = with("yes");
    assert_eq!(bad.status.code(), Some(2));
    let e = stderr(&bad);
    assert!(
        e.contains("environment setting ATTN_DUMP_ASM is `yes`") && !e.contains("spec:"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// An MLA c_kv of the wrong rank is named with the shape it should have, Skv left as Skv.
#[test]
fn an_mla_latent_of_the_wrong_rank_is_named_with_its_expected_shape() {
    let dir = scratch("mla-rank");
    let file = dir.join("in.safetensors");
    let tensor = |shape: &[usize]| {
        let n: usize = shape.iter().product();
        (vec![0u8; 4 * n], shape.to_vec())
    };
    let tensors = [
        ("q_nope", tensor(&[1, 2, 3, 8])),
        ("q_pe", tensor(&[1, 2, 3, 4])),
        ("c_kv", tensor(&[5, 16])),
        ("k_pe", tensor(&[1, 5, 4])),
        ("w_kv_b", tensor(&[32, 16])),
    ];
    let views: Vec<(&str, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(name, (bytes, shape))| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .unwrap();
            (*name, view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &file).unwrap();
    let out = dir.join("out.safetensors");
    let o = attnc(
        &[
            "run",
            "--spec",
            "heads = 2, head_dim = 8, mla(latent_rank = 16, rope_dim = 4)",
            "--input",
            file.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ],
        &dir.join("cache"),
    );
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("`c_kv` has shape [5, 16], expected [1, Skv, 16]"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
