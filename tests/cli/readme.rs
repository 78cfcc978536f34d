//! The README's `attnc` command lines: every command exists and takes every flag they show.

use crate::{attnc, stderr, stdout};

/// Shell words of `line` (double and single quotes group; a `#` outside quotes starts a
/// comment).
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word: Option<String> = None;
    let mut quote = None;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.get_or_insert_with(String::new).push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                word.get_or_insert_with(String::new);
            }
            (None, '#') if word.is_none() => break,
            (None, c) if c.is_whitespace() => out.extend(word.take()),
            (None, c) => word.get_or_insert_with(String::new).push(c),
        }
    }
    out.extend(word);
    out
}

/// The arguments of every `attnc` command in the README's `sh` blocks, continuation lines
/// joined.
fn readme_commands() -> Vec<Vec<String>> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let mut commands = Vec::new();
    let mut in_sh = false;
    let mut line = String::new();
    for raw in readme.lines() {
        if raw.starts_with("```") {
            in_sh = raw == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let (body, more) = match raw.trim_end().strip_suffix('\\') {
            Some(body) => (body, true),
            None => (raw, false),
        };
        line.push_str(body);
        line.push(' ');
        if more {
            continue;
        }
        if let Some((_, args)) = line.split_once("--bin attnc --") {
            commands.push(words(args));
        }
        line.clear();
    }
    commands
}

#[test]
fn the_shell_words_of_a_line() {
    assert_eq!(
        words(r#"check "heads = 2, head_dim = 8" --seq 4   # a comment"#),
        ["check", "heads = 2, head_dim = 8", "--seq", "4"]
    );
    assert_eq!(words("emit 'a # b' -o x"), ["emit", "a # b", "-o", "x"]);
}

#[test]
fn every_readme_command_takes_the_flags_it_shows() {
    let commands = readme_commands();
    assert!(commands.len() >= 15, "{} commands found", commands.len());
    for args in commands {
        // The command, and a subcommand of it (`cache list`) where there is one.
        let mut path: Vec<&str> = vec![&args[0]];
        if args.len() > 1 && args[1].chars().all(|c| c.is_ascii_lowercase()) {
            let mut with_sub = path.clone();
            with_sub.push(&args[1]);
            with_sub.push("--help");
            if attnc(&with_sub).status.success() {
                path.push(&args[1]);
            }
        }
        let mut help_args = path.clone();
        help_args.push("--help");
        let help = attnc(&help_args);
        assert!(help.status.success(), "{args:?}: {}", stderr(&help));
        let help = stdout(&help);
        for flag in args.iter().filter(|a| a.starts_with('-')) {
            let flag = flag.split('=').next().unwrap();
            assert!(
                help.split(|c: char| c.is_whitespace() || c == ',')
                    .any(|w| w == flag),
                "the README's `attnc {}` shows {flag}, which its --help does not list",
                args.join(" ")
            );
        }
    }
}
