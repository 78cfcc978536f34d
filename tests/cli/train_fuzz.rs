//! `attnc train` under hostile input: options, corpora, model TOMLs and tampered run folders.
//! Every case ends in a finished run (exit 0) or a refusal that says why (exit 2, `error:`),
//! never a panic, an abort or a signal; a refused resume leaves the run folder's checkpoint as
//! it was. Needs the `candle` feature, as training does.

use crate::stderr;
use std::path::{Path, PathBuf};
use std::process::Output;

fn folder(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("attnc-fuzz-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const MODEL: &str = "vocab = 256\nhidden = 16\nlayers = 1\n\
    attention = \"heads = 2, head_dim = 8, mask = causal, position = rope\"\n";

/// A base model and corpus in `dir`.
fn inputs(dir: &Path) -> (String, String) {
    let m = dir.join("m.toml");
    std::fs::write(&m, MODEL).unwrap();
    let data = dir.join("corpus.txt");
    std::fs::write(&data, "a fuzzed run trains on this text. ".repeat(40)).unwrap();
    (path(&m), path(&data))
}

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

fn run(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_attnc"))
        .args(args)
        .env("ATTN_CACHE_DIR", crate::test_cache())
        .output()
        .unwrap()
}

/// The outcome must be a finish or a reasoned refusal.
fn settled(o: &Output, case: &str) {
    let err = stderr(o);
    match o.status.code() {
        Some(0) => {}
        Some(2) => assert!(
            err.contains("error:"),
            "{case}: exit 2 without a reason: {err}"
        ),
        other => panic!("{case}: exit {other:?} (a panic, abort or signal): {err}"),
    }
    assert!(!err.contains("panicked"), "{case}: {err}");
}

/// A small training run of `model` on `data` into `out` with `extra` flags.
fn train(model: &str, data: &str, out: &Path, extra: &[&str]) -> Output {
    let out = path(out);
    let mut args = vec![
        "train",
        "--model",
        model,
        "--data",
        data,
        "--out",
        &out,
        "--seq",
        "8",
        "--batch",
        "2",
        "--eval-every",
        "2",
        "--steps",
        "2",
    ];
    args.extend(extra);
    run(&args)
}

#[test]
fn hostile_options_finish_or_are_refused() {
    let dir = folder("options");
    let (m, data) = inputs(&dir);
    let flags: [(&str, &[&str]); 11] = [
        ("--ranks", &["1", "2", "0", "65", "3"]),
        ("--context-parallel", &["1", "2", "3"]),
        ("--scheme", &["ring", "ulysses", "zigzag"]),
        ("--steps", &["0", "1", "3", "100000001", "-1", "abc", "1e3"]),
        ("--batch", &["0", "1", "4097", "3"]),
        ("--seq", &["0", "1", "65537", "5", "100000"]),
        (
            "--lr",
            &["0", "-1", "NaN", "inf", "1e-30", "11", "0.01", "1e400"],
        ),
        ("--warmup", &["0", "100000001", "7", "-3"]),
        ("--weight-decay", &["-1", "0", "1e308", "NaN", "2"]),
        ("--eval-every", &["0", "1", "100000001"]),
        (
            "--seed",
            &["0", "18446744073709551615", "-1", "18446744073709551616"],
        ),
    ];
    // A small run, some of whose flags take a hostile value; each flag said once.
    let small = [
        ("--steps", "2"),
        ("--batch", "2"),
        ("--seq", "8"),
        ("--eval-every", "2"),
    ];
    let mut rng = attn::inputs::XorShift::new(46);
    let mut finished = 0;
    for case in 0..24 {
        let mut chosen: Vec<(&str, &str)> = small.to_vec();
        for (flag, values) in flags {
            if rng.next_u64().is_multiple_of(3) {
                let value = values[(rng.next_u64() % values.len() as u64) as usize];
                chosen.retain(|(f, _)| *f != flag);
                chosen.push((flag, value));
            }
        }
        let out = path(&dir.join(format!("run{case}")));
        let mut args = vec!["train", "--model", &m, "--data", &data, "--out", &out];
        args.extend(chosen.iter().flat_map(|(f, v)| [*f, *v]));
        let o = run(&args);
        settled(&o, &format!("{chosen:?}"));
        finished += usize::from(o.status.success());
    }
    assert!(
        (1..24).contains(&finished),
        "{finished} of 24 finished: the cases should mix runs and refusals"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn hostile_corpora_finish_or_are_refused() {
    let dir = folder("corpora");
    let (m, _) = inputs(&dir);
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        path(&p)
    };
    let mut cases = vec![
        write("empty.txt", b""),
        write("one.txt", b"a"),
        write("binary.bin", &[0, 159, 146, 150, 255, 0, 1]),
        write(
            "cut-utf8.txt",
            &["é".repeat(300).as_bytes(), &[0xc3]].concat(),
        ),
        write("nul.txt", &vec![0u8; 4000]),
        write("lines.txt", "\n".repeat(5000).as_bytes()),
        path(&dir),
        "/dev/null".to_string(),
        path(&dir.join("missing.txt")),
    ];
    let sparse = dir.join("sparse.txt");
    std::fs::File::create(&sparse)
        .unwrap()
        .set_len(3 << 30)
        .unwrap();
    cases.push(path(&sparse));
    for (i, data) in cases.iter().enumerate() {
        let o = train(&m, data, &dir.join(format!("run{i}")), &[]);
        settled(&o, data);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn hostile_model_tomls_finish_or_are_refused() {
    let dir = folder("tomls");
    let (_, data) = inputs(&dir);
    std::fs::write(dir.join("garbage.safetensors"), b"not a safetensors file").unwrap();
    let tomls = [
        "",
        "vocab = 0\nhidden = 16\nlayers = 1\nattention = \"heads = 2, head_dim = 8\"\n",
        "vocab = 256\nhidden = -16\nlayers = 1\nattention = \"heads = 2, head_dim = 8\"\n",
        "vocab = 256\nhidden = 16\nlayers = 5000\nattention = \"heads = 2, head_dim = 8\"\n",
        "vocab = 256\nhidden = 16\nlayers = 1\nattention = \"heads = 2, head_dim = 0\"\n",
        "vocab = 256\nhidden = 16\nlayers = 1\nattention = \"heads = 2, head_dim = 8, mla(latent_rank = 4, rope_dim = 4)\"\n",
        "vocab = 256\nhidden = 16\nlayers = 1\nattention = 3\n",
        "vocab = 256\nhidden = 16\nlayers = 2\npattern = [\"a\", \"b\", \"a\"]\n[attention]\na = \"heads = 2, head_dim = 8\"\nb = \"heads = 2, head_dim = 8, mask = causal\"\n",
        "vocab = 256\nhidden = 16\nlayers = 1\nattention = \"heads = 2, head_dim = 8\"\n[moe]\nexperts = 0\ntop_k = 1\n",
        "vocab = 256\nhidden = 16\nlayers = 1\nattention = \"heads = 2, head_dim = 8\"\n[moe]\nexperts = 4096\ntop_k = 4096\nintermediate = 4194304\n",
        "vocab = 256\nhidden = 16\nlayers = 1\nattention = \"heads = 2, head_dim = 8\"\nweights = \"missing.safetensors\"\n",
        "vocab = 256\nhidden = 16\nlayers = 1\nattention = \"heads = 2, head_dim = 8\"\nweights = \"garbage.safetensors\"\n",
        "vocab = 256\nhidden = 16\nlayers = 1\nattention = \"heads = 2, head_dim = 8\"\nweights = \"../x.safetensors\"\n",
        "vocab = 256\nhidden = 16\nlayers = 1\nattention = \"heads = 2, head_dim = 8, score_mod = |s, b, h, q, k| s * 1e38 * 1e38\"\n",
        "vocab = 256\nhidden = 16\nlayers = 1\nattention = \"heads = 2, head_dim = 8\"\nnorm_eps = 0.0\n",
        "vocab = 256\nhidden = 16\nlayers = 1\nattention = \"heads = 2, head_dim = 8\"\nunknown = 1\n",
        "[[[",
    ];
    for (i, text) in tomls.iter().enumerate() {
        let m = dir.join(format!("m{i}.toml"));
        std::fs::write(&m, text).unwrap();
        let o = train(&path(&m), &data, &dir.join(format!("run{i}")), &[]);
        settled(&o, text);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A copy of the files of `from` in `to`.
fn copy_run(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// `text` with the JSON value at `path` (keys from the top) set to `value`.
fn set_json(text: &str, path: &[&str], value: &str) -> String {
    let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
    let slot = path.iter().fold(&mut v, |v, k| &mut v[*k]);
    *slot = serde_json::from_str(value).unwrap();
    v.to_string()
}

/// A change made to a copy of a run folder.
type Tamper = Box<dyn Fn(&Path)>;

#[test]
fn tampered_run_folders_resume_or_are_refused() {
    let dir = folder("tampered");
    let (m, data) = inputs(&dir);
    let good = dir.join("good");
    let o = train(&m, &data, &good, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let state = std::fs::read_to_string(good.join("state.json")).unwrap();
    let mut cases: Vec<(String, Tamper)> = Vec::new();
    let fields: [(&[&str], &[&str]); 12] = [
        (
            &["step"],
            &[
                "0",
                "-1",
                "1e20",
                "\"x\"",
                "null",
                "18446744073709551615",
                "1",
            ],
        ),
        (&["rng"], &["0", "-5", "\"rng\""]),
        (&["format"], &["1", "3", "null"]),
        (&["options", "lr"], &["-1", "0", "1e300", "\"fast\""]),
        (&["options", "weight_decay"], &["-0.5", "1e300"]),
        (&["options", "batch"], &["65536", "0", "1.5"]),
        (&["options", "seq"], &["1000000000", "0"]),
        (&["options", "steps"], &["0", "100000001", "1"]),
        (&["options", "eval_every"], &["0"]),
        (
            &["options", "tokenizer"],
            &["\"/nowhere/tokenizer.json\"", "5"],
        ),
        (
            &["weights"],
            &["\"../../etc/passwd\"", "\"model-1.safetensors\"", "null"],
        ),
        (&["model"], &["\"vocab = 0\"", "\"[[[\"", "7"]),
    ];
    for (key, values) in fields {
        for value in values {
            let edited = set_json(&state, key, value);
            cases.push((
                format!("state.json {key:?} = {value}"),
                Box::new(move |run: &Path| {
                    std::fs::write(run.join("state.json"), &edited).unwrap()
                }),
            ));
        }
    }
    let edited = set_json(&state, &["data", "hash"], "\"0000\"");
    cases.push((
        "another corpus's hash".into(),
        Box::new(move |run: &Path| std::fs::write(run.join("state.json"), &edited).unwrap()),
    ));
    for file in [
        "state.json",
        "model-2.safetensors",
        "optimizer-2.safetensors",
        "metrics.jsonl",
        "steps.jsonl",
        "attnc-run.json",
    ] {
        let f = file.to_string();
        cases.push((
            format!("{file} removed"),
            Box::new(move |run: &Path| std::fs::remove_file(run.join(&f)).unwrap()),
        ));
        let f = file.to_string();
        cases.push((
            format!("{file} cut in half"),
            Box::new(move |run: &Path| {
                let bytes = std::fs::read(run.join(&f)).unwrap();
                std::fs::write(run.join(&f), &bytes[..bytes.len() / 2]).unwrap()
            }),
        ));
        let f = file.to_string();
        cases.push((
            format!("{file} garbage"),
            Box::new(move |run: &Path| std::fs::write(run.join(&f), b"\x00\xffgarbage{[").unwrap()),
        ));
    }
    cases.push((
        "a NaN metric".into(),
        Box::new(|run: &Path| {
            std::fs::write(
                run.join("metrics.jsonl"),
                "{\"step\":2,\"train_loss\":NaN}\n",
            )
            .unwrap()
        }),
    ));
    cases.push((
        "steps out of order".into(),
        Box::new(|run: &Path| {
            let text = std::fs::read_to_string(run.join("steps.jsonl")).unwrap();
            let lines: Vec<&str> = text.lines().rev().collect();
            std::fs::write(run.join("steps.jsonl"), lines.join("\n") + "\n").unwrap()
        }),
    ));
    cases.push((
        "a stale checkpoint beside the last".into(),
        Box::new(|run: &Path| {
            std::fs::copy(
                run.join("model-2.safetensors"),
                run.join("model-1.safetensors"),
            )
            .unwrap();
            std::fs::write(run.join(".state.json.partial"), b"half").unwrap();
        }),
    ));
    for (i, (case, tamper)) in cases.iter().enumerate() {
        let run_dir = dir.join(format!("t{i}"));
        copy_run(&good, &run_dir);
        tamper(&run_dir);
        let before = std::fs::read(run_dir.join("model-2.safetensors")).ok();
        let o = run(&["train", "--resume", &path(&run_dir), "--steps", "3"]);
        settled(&o, case);
        if o.status.code() == Some(2) {
            assert_eq!(
                std::fs::read(run_dir.join("model-2.safetensors")).ok(),
                before,
                "{case}: a refused resume changed the checkpoint"
            );
        } else {
            let state = std::fs::read_to_string(run_dir.join("state.json")).unwrap();
            assert!(state.contains("\"step\": 3"), "{case}: {state}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Options read back from a run's state.json are checked as the command line checks them: a
/// negative learning rate (which trained uphill), a negative weight decay or a batch of 65,536
/// are refused, naming the option.
#[test]
fn a_resumed_runs_options_are_checked_again() {
    let dir = folder("options-again");
    let (m, data) = inputs(&dir);
    let good = dir.join("good");
    let o = train(&m, &data, &good, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let state = std::fs::read_to_string(good.join("state.json")).unwrap();
    for (key, value, says) in [
        ("lr", "-0.003", "--lr -0.003 is out of range"),
        (
            "weight_decay",
            "-0.5",
            "--weight-decay -0.5 is out of range",
        ),
        (
            "batch",
            "65536",
            "--batch 65536 is out of range; allowed: 1 to 4096",
        ),
        ("steps", "100000001", "--steps 100000001 is out of range"),
    ] {
        let run_dir = dir.join(key);
        copy_run(&good, &run_dir);
        let edited = set_json(&state, &["options", key], value);
        std::fs::write(run_dir.join("state.json"), edited).unwrap();
        let o = run(&["train", "--resume", &path(&run_dir)]);
        assert_eq!(o.status.code(), Some(2), "{key}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{key}: {}", stderr(&o));
    }
    std::fs::remove_dir_all(&dir).ok();
}
