//! The wire check: `proto/aliquot.v1.wire` records every message, field,
//! enum value, reservation and method of `aliquot.v1`, one per line, as
//! compiled. This test fails on a change that breaks clients already built
//! (what `buf breaking` checks): a field or enum value removed without
//! `reserved`, renumbered, renamed or retyped (type, label or oneof); a
//! message, enum, service or method removed; a method's types or streaming
//! changed. It also fails on any addition until the record is rewritten
//! (`ALIQUOT_WRITE_WIRE=1 cargo test -p aliquot-proto --test wire`), so each
//! change of the wire shows in review as a diff of that file. A breaking
//! change is never re-recorded.

use std::collections::{BTreeMap, BTreeSet};

use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, EnumDescriptorProto, FieldDescriptorProto, FileDescriptorSet};

const RECORD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/aliquot.v1.wire");

fn scalar(t: Type) -> &'static str {
    match t {
        Type::Double => "double",
        Type::Float => "float",
        Type::Int64 => "int64",
        Type::Uint64 => "uint64",
        Type::Int32 => "int32",
        Type::Fixed64 => "fixed64",
        Type::Fixed32 => "fixed32",
        Type::Bool => "bool",
        Type::String => "string",
        Type::Group => "group",
        Type::Message => "message",
        Type::Bytes => "bytes",
        Type::Uint32 => "uint32",
        Type::Enum => "enum",
        Type::Sfixed32 => "sfixed32",
        Type::Sfixed64 => "sfixed64",
        Type::Sint32 => "sint32",
        Type::Sint64 => "sint64",
    }
}

fn field_line(m: &DescriptorProto, f: &FieldDescriptorProto) -> String {
    let ty = match f.r#type() {
        Type::Message | Type::Enum => f.type_name().trim_start_matches('.').to_string(),
        t => scalar(t).to_string(),
    };
    let mut line = format!("  field {} {} {ty}", f.number(), f.name());
    if f.label() == Label::Repeated {
        line.push_str(" repeated");
    }
    if f.proto3_optional() {
        line.push_str(" optional");
    } else if let Some(o) = f.oneof_index {
        let name = m.oneof_decl.get(o as usize).map_or("?", |d| d.name());
        line.push_str(&format!(" oneof {name}"));
    }
    line
}

fn ranges(out: &mut Vec<String>, r: impl Iterator<Item = (i32, i32)>) {
    for (start, end) in r {
        if start == end {
            out.push(format!("  reserved {start}"));
        } else {
            out.push(format!("  reserved {start} to {end}"));
        }
    }
}

fn message(out: &mut Vec<String>, prefix: &str, m: &DescriptorProto) {
    let name = format!("{prefix}.{}", m.name());
    out.push(format!("message {name}"));
    let mut fields: Vec<&FieldDescriptorProto> = m.field.iter().collect();
    fields.sort_by_key(|f| f.number());
    for f in fields {
        out.push(field_line(m, f));
    }
    // Message reserved ranges are end-exclusive in descriptors.
    ranges(
        out,
        m.reserved_range.iter().map(|r| (r.start(), r.end() - 1)),
    );
    for n in &m.reserved_name {
        out.push(format!("  reserved name {n}"));
    }
    for e in &m.enum_type {
        enumeration(out, &name, e);
    }
    for n in &m.nested_type {
        message(out, &name, n);
    }
}

fn enumeration(out: &mut Vec<String>, prefix: &str, e: &EnumDescriptorProto) {
    out.push(format!("enum {prefix}.{}", e.name()));
    let mut values: Vec<_> = e.value.iter().collect();
    values.sort_by_key(|v| v.number());
    for v in values {
        out.push(format!("  value {} {}", v.number(), v.name()));
    }
    // Enum reserved ranges are end-inclusive.
    ranges(out, e.reserved_range.iter().map(|r| (r.start(), r.end())));
    for n in &e.reserved_name {
        out.push(format!("  reserved name {n}"));
    }
}

/// The record of a compiled descriptor set, one item a line.
fn render(fds: &FileDescriptorSet) -> String {
    let mut out = Vec::new();
    let mut files: Vec<_> = fds.file.iter().collect();
    files.sort_by_key(|f| f.name().to_string());
    for f in files {
        out.push(format!("file {}", f.name()));
        let pkg = f.package();
        for m in &f.message_type {
            message(&mut out, pkg, m);
        }
        for e in &f.enum_type {
            enumeration(&mut out, pkg, e);
        }
        for s in &f.service {
            out.push(format!("service {pkg}.{}", s.name()));
            for m in &s.method {
                let stream = |b: bool| if b { "stream " } else { "" };
                out.push(format!(
                    "  method {} ({}{}) returns ({}{})",
                    m.name(),
                    stream(m.client_streaming()),
                    m.input_type().trim_start_matches('.'),
                    stream(m.server_streaming()),
                    m.output_type().trim_start_matches('.'),
                ));
            }
        }
    }
    out.push(String::new());
    out.join("\n")
}

/// A record read back: per container (message, enum, service), its
/// numbered items (number -> (name, the rest of the line)), its reserved
/// numbers and names.
#[derive(Default)]
struct Container {
    items: BTreeMap<i64, (String, String)>,
    reserved: Vec<(i64, i64)>,
    reserved_names: BTreeSet<String>,
}

type Parsed = BTreeMap<String, Container>;

fn parse(record: &str) -> Parsed {
    let mut out = Parsed::new();
    let mut cur = String::new();
    for line in record.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            [] | ["file", ..] => {}
            [kind @ ("message" | "enum" | "service"), name] => {
                cur = format!("{kind} {name}");
                out.entry(cur.clone()).or_default();
            }
            ["field" | "value", n, name, rest @ ..] => {
                let c = out.entry(cur.clone()).or_default();
                c.items
                    .insert(n.parse().unwrap(), (name.to_string(), rest.join(" ")));
            }
            ["method", name, rest @ ..] => {
                // Methods are keyed by name: a hash of it stands for a number.
                let c = out.entry(cur.clone()).or_default();
                let key = name
                    .bytes()
                    .fold(0i64, |h, b| h.wrapping_mul(31) + b as i64);
                c.items.insert(key, (name.to_string(), rest.join(" ")));
            }
            ["reserved", "name", n] => {
                out.entry(cur.clone())
                    .or_default()
                    .reserved_names
                    .insert(n.to_string());
            }
            ["reserved", a] => {
                let a = a.parse().unwrap();
                out.entry(cur.clone()).or_default().reserved.push((a, a));
            }
            ["reserved", a, "to", b] => {
                out.entry(cur.clone())
                    .or_default()
                    .reserved
                    .push((a.parse().unwrap(), b.parse().unwrap()));
            }
            _ => panic!("unreadable wire record line: {line:?}"),
        }
    }
    out
}

/// What `now` breaks of `was`, one sentence each.
fn breaking(was: &str, now: &str) -> Vec<String> {
    let (was, now) = (parse(was), parse(now));
    let mut out = Vec::new();
    for (name, old) in &was {
        let Some(new) = now.get(name) else {
            out.push(format!("{name} removed"));
            continue;
        };
        let what = if name.starts_with("service") {
            "method"
        } else if name.starts_with("enum") {
            "value"
        } else {
            "field"
        };
        for (n, (iname, rest)) in &old.items {
            match new.items.get(n) {
                Some((nn, _)) if nn != iname => {
                    out.push(format!("{name}: {what} {n} renamed from {iname} to {nn}"))
                }
                Some((_, nrest2)) if nrest2 != rest => out.push(format!(
                    "{name}: {what} {iname} changed from `{rest}` to `{nrest2}`"
                )),
                Some(_) => {}
                None => {
                    if let Some((m, _)) = new.items.iter().find(|(_, (x, _))| x == iname) {
                        out.push(format!("{name}: {what} {iname} renumbered from {n} to {m}"));
                    } else if what == "method" {
                        out.push(format!("{name}: method {iname} removed"));
                    } else if !new.reserved.iter().any(|&(a, b)| a <= *n && *n <= b) {
                        out.push(format!(
                            "{name}: {what} {n} ({iname}) removed without `reserved {n}`"
                        ));
                    }
                }
            }
        }
        for &(a, b) in &old.reserved {
            if !new.reserved.iter().any(|&(x, y)| x <= a && b <= y) {
                out.push(format!("{name}: reservation {a}..={b} dropped"));
            }
        }
        for n in &old.reserved_names {
            if !new.reserved_names.contains(n) {
                out.push(format!("{name}: reserved name {n} dropped"));
            }
        }
        // A number taken again while reserved.
        for (n, (iname, _)) in &new.items {
            if what != "method" && new.reserved.iter().any(|&(a, b)| a <= *n && *n <= b) {
                out.push(format!("{name}: {what} {iname} reuses reserved number {n}"));
            }
        }
    }
    out
}

fn current() -> String {
    let fds = FileDescriptorSet::decode(aliquot_proto::FILE_DESCRIPTOR_SET).unwrap();
    render(&fds)
}

#[test]
fn the_wire_matches_its_record() {
    let now = current();
    let was = std::fs::read_to_string(RECORD).unwrap_or_default();
    if !was.is_empty() {
        let broken = breaking(&was, &now);
        assert!(
            broken.is_empty(),
            "aliquot.v1 breaks clients built against {RECORD}:\n  {}\n\
             (add fields and values with new numbers; `reserved` what is retired)",
            broken.join("\n  ")
        );
    }
    if was != now {
        if std::env::var("ALIQUOT_WRITE_WIRE").as_deref() == Ok("1") {
            std::fs::write(RECORD, &now).unwrap();
            return;
        }
        let added: Vec<&str> = now
            .lines()
            .filter(|l| !was.lines().any(|w| w == *l))
            .collect();
        panic!(
            "aliquot.v1 changed compatibly, but {RECORD} does not record it yet:\n  {}\n\
             re-record it: ALIQUOT_WRITE_WIRE=1 cargo test -p aliquot-proto --test wire",
            added.join("\n  ")
        );
    }
}

/// The check itself, on edits of the real record: each kind of breakage
/// is named, a retirement with `reserved` and an addition are not.
#[test]
fn each_breaking_change_is_named() {
    let was = current();
    let field = was
        .lines()
        .position(|l| l.starts_with("  field 2 "))
        .expect("a message with a field 2");
    let owner = was
        .lines()
        .take(field)
        .filter(|l| l.starts_with("message"))
        .last()
        .unwrap();
    let line = was.lines().nth(field).unwrap().to_string();
    let w: Vec<&str> = line.split_whitespace().collect();
    let edit = |f: &dyn Fn(&str) -> Option<String>| -> String {
        let mut out: Vec<String> = Vec::new();
        for (k, l) in was.lines().enumerate() {
            if k == field {
                if let Some(n) = f(l) {
                    out.push(n);
                }
            } else {
                out.push(l.to_string());
            }
        }
        out.join("\n")
    };
    let says = |now: &str, what: &str| {
        let b = breaking(&was, now);
        assert!(
            b.iter()
                .any(|s| s.contains(what) && s.contains(owner.split(' ').nth(1).unwrap())),
            "{what}: {b:?}"
        );
    };
    says(&edit(&|_| None), "removed without `reserved 2`");
    says(
        &edit(&|_| Some(format!("  field 999 {} {}", w[2], w[3..].join(" ")))),
        "renumbered from 2 to 999",
    );
    says(
        &edit(&|_| Some(format!("  field 2 renamed_x {}", w[3..].join(" ")))),
        "renamed",
    );
    let other = if w[3] == "bytes" { "string" } else { "bytes" };
    says(
        &edit(&|_| Some(format!("  field 2 {} {other}", w[2]))),
        "changed from",
    );
    // Retired with `reserved`: compatible.
    assert!(breaking(&was, &edit(&|_| Some("  reserved 2".into()))).is_empty());
    // A field added: compatible (but the record must be rewritten).
    assert!(
        breaking(
            &was,
            &edit(&|l| Some(format!("{l}\n  field 998 added_x string")))
        )
        .is_empty()
    );
    // A method's types and a method removed.
    let m = was
        .lines()
        .position(|l| l.starts_with("  method "))
        .unwrap();
    let ml = was.lines().nth(m).unwrap();
    let name = ml.split_whitespace().nth(1).unwrap();
    let changed = was.replace(ml, &format!("  method {name} (stream x.Y) returns (x.Z)"));
    assert!(
        breaking(&was, &changed)
            .iter()
            .any(|s| s.contains(name) && s.contains("changed"))
    );
    let removed = was.replace(&format!("{ml}\n"), "");
    assert!(
        breaking(&was, &removed)
            .iter()
            .any(|s| s.contains(&format!("method {name} removed")))
    );
}
