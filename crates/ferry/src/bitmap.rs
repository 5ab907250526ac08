//! `ferry bitmap`: manage the persistent dirty bitmaps of a qcow2 image, spelled as
//! `qemu-img bitmap`: several operations in one call run in the order given, then the
//! image is closed (bitmaps written back, `in_use` cleared). The image is opened for
//! writing with the locks qemu's writers take: an image another program uses is refused.

use anyhow::{bail, Context, Result};
use ferry_backend::{Access, ImageUse};
use ferry_qcow2::{Options, Qcow2};
use std::path::{Path, PathBuf};

const USAGE: &str = "usage: ferry bitmap (--add [-g GRANULARITY] [--disabled] | --remove | --clear | --enable | \
--disable | --merge SOURCE [-b SOURCE_IMAGE])... IMAGE BITMAP";

#[derive(clap::Args)]
#[command(override_usage = USAGE, disable_help_flag = true)]
pub struct BitmapArgs {
    /// Operations, in the order they run, then IMAGE (a qcow2 file) and BITMAP:
    /// --add (-g/--granularity SIZE: 512 to 2G, default the cluster size (at least 4K);
    /// --disabled: do not record writes), --remove, --clear, --enable, --disable,
    /// --merge SOURCE (the bitmap SOURCE of IMAGE, or of -b/--source-file SOURCE_IMAGE).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "ARGS")]
    args: Vec<String>,
}

/// `ferry bitmap` as completion scripts see it: its operations as options, IMAGE and
/// BITMAP after them. Only the scripts use it: the command line itself is parsed by
/// [`parse`], which keeps the operations in the order given.
pub(crate) fn for_completion(cmd: &clap::Command) -> clap::Command {
    use clap::{Arg, ArgAction, ValueHint};
    let op = |name: &'static str, help: &'static str| Arg::new(name).long(name).action(ArgAction::SetTrue).help(help);
    let mut c = clap::Command::new("bitmap").override_usage(USAGE).disable_help_flag(true);
    if let Some(about) = cmd.get_about() {
        c = c.about(about.clone());
    }
    c.args([
        op("add", "Add BITMAP"),
        op("remove", "Remove BITMAP"),
        op("clear", "Clear BITMAP"),
        op("enable", "Enable BITMAP"),
        op("disable", "Disable BITMAP"),
        op("disabled", "With --add: do not record writes"),
        Arg::new("merge").long("merge").value_name("SOURCE").help("Merge the bitmap SOURCE into BITMAP"),
        Arg::new("granularity").short('g').long("granularity").value_name("SIZE").help("With --add: its granularity"),
        Arg::new("source-file")
            .short('b')
            .long("source-file")
            .value_name("SOURCE_IMAGE")
            .value_hint(ValueHint::FilePath)
            .help("With --merge: the image SOURCE is in"),
        Arg::new("format").short('f').long("format").value_parser(["qcow2"]).help("The image's format"),
        Arg::new("image").value_name("IMAGE").value_hint(ValueHint::FilePath),
        Arg::new("bitmap").value_name("BITMAP"),
    ])
}

/// One operation on BITMAP.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    Add,
    Remove,
    Clear,
    Enable,
    Disable,
    Merge(String),
}

#[derive(Debug, PartialEq, Eq)]
struct Parsed {
    ops: Vec<Op>,
    granularity: Option<u64>,
    disabled: bool,
    source_image: Option<PathBuf>,
    image: PathBuf,
    bitmap: String,
}

fn parse(args: &[String]) -> Result<Parsed> {
    let mut ops = Vec::new();
    let (mut granularity, mut disabled, mut source_image) = (None, false, None);
    let mut positional = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (a.as_str(), None),
        };
        let mut value = |what: &str| -> Result<String> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => it.next().cloned().with_context(|| format!("{what} needs a value; {USAGE}")),
            }
        };
        match flag {
            "--add" => ops.push(Op::Add),
            "--remove" => ops.push(Op::Remove),
            "--clear" => ops.push(Op::Clear),
            "--enable" => ops.push(Op::Enable),
            "--disable" => ops.push(Op::Disable),
            "--disabled" => disabled = true,
            "--merge" => ops.push(Op::Merge(value("--merge")?)),
            "-g" | "--granularity" => {
                let v = value("--granularity")?;
                granularity = Some(ferry_backend::parse_size(&v).with_context(|| format!("--granularity {v:?}"))?);
            }
            "-b" | "--source-file" => source_image = Some(PathBuf::from(value("--source-file")?)),
            "-f" | "-F" | "--format" | "--source-format" => {
                let v = value(flag)?;
                if v != "qcow2" {
                    bail!("{flag} {v}: persistent bitmaps live in qcow2 images only");
                }
            }
            "-h" | "--help" => bail!("{USAGE}"),
            "--" => positional.extend(it.by_ref().cloned()),
            f if f.starts_with('-') && f.len() > 1 => bail!("unknown option {f:?}; {USAGE}"),
            _ => positional.push(a.clone()),
        }
    }
    let [image, bitmap]: [String; 2] =
        positional.try_into().map_err(|p: Vec<String>| anyhow::anyhow!("expected IMAGE BITMAP, got {p:?}; {USAGE}"))?;
    if ops.is_empty() {
        bail!("no operation given; {USAGE}");
    }
    if granularity.is_some() && !ops.contains(&Op::Add) {
        bail!("--granularity goes with --add");
    }
    if disabled && !ops.contains(&Op::Add) {
        bail!("--disabled goes with --add");
    }
    if source_image.is_some() && !ops.iter().any(|o| matches!(o, Op::Merge(_))) {
        bail!("--source-file goes with --merge");
    }
    Ok(Parsed { ops, granularity, disabled, source_image, image: PathBuf::from(image), bitmap })
}

/// The same file (device and inode: hard links and other spellings too).
fn same_file(a: &Path, b: &Path) -> bool {
    match (ferry_backend::FileId::of_path(a), ferry_backend::FileId::of_path(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

pub(crate) const HELP: &str = "Operations run in the order given, then the image is closed (bitmaps written back):
  --add                      create BITMAP, recording writes from now on
    -g, --granularity SIZE   its granularity: 512 to 2G (default: the cluster size, at least 4K)
    --disabled               do not record writes (as --add --disable)
  --remove                   remove BITMAP (also an inconsistent one)
  --clear                    clear every bit of BITMAP
  --enable, --disable        start / stop recording writes in BITMAP
  --merge SOURCE             OR the bitmap SOURCE into BITMAP
    -b, --source-file IMAGE  the image SOURCE is in (default: IMAGE)
IMAGE is opened for writing: an image another program uses is refused.";

pub fn run(args: BitmapArgs) -> Result<i32> {
    if args.args.is_empty() || args.args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}\n\n{HELP}");
        return Ok(if args.args.is_empty() { 1 } else { 0 });
    }
    let p = parse(&args.args)?;
    let q = Qcow2::open_for(&p.image, &Options::default(), ImageUse::new(Access::Write))
        .with_context(|| format!("cannot open {} for changing its bitmaps", p.image.display()))?;
    let source = match &p.source_image {
        Some(s) if !same_file(s, &p.image) => Some(
            Qcow2::open_for(s, &Options { read_only: true, ..Options::default() }, ImageUse::new(Access::Source))
                .with_context(|| format!("cannot open the merge source {}", s.display()))?,
        ),
        _ => None,
    };
    let name = p.bitmap.as_str();
    for op in &p.ops {
        let r = match op {
            Op::Add => q.bitmap_add(name, p.granularity, p.disabled),
            Op::Remove => q.bitmap_remove(name),
            Op::Clear => q.bitmap_clear(name),
            Op::Enable => q.bitmap_enable(name, true),
            Op::Disable => q.bitmap_enable(name, false),
            Op::Merge(src) => {
                let bits = source.as_ref().unwrap_or(&q).bitmap_bits(src);
                bits.and_then(|b| q.bitmap_merge(name, &b))
            }
        };
        let what = match op {
            Op::Add => "--add".to_string(),
            Op::Remove => "--remove".into(),
            Op::Clear => "--clear".into(),
            Op::Enable => "--enable".into(),
            Op::Disable => "--disable".into(),
            Op::Merge(s) => format!("--merge {s:?}"),
        };
        r.with_context(|| format!("{}: {what} {name:?}", p.image.display()))?;
    }
    drop(source);
    q.close().with_context(|| format!("cannot write the bitmaps of {}", p.image.display()))?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(a: &[&str]) -> Result<Parsed> {
        parse(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn parses_qemu_img_spelling_in_order() {
        let x = p(&["--add", "-g", "2M", "--disabled", "--merge", "b1", "-b", "o.qcow2", "i.qcow2", "b0"]).unwrap();
        assert_eq!(x.ops, [Op::Add, Op::Merge("b1".into())]);
        assert_eq!(x.granularity, Some(2 << 20));
        assert!(x.disabled);
        assert_eq!(x.source_image, Some(PathBuf::from("o.qcow2")));
        assert_eq!((x.image, x.bitmap), (PathBuf::from("i.qcow2"), "b0".to_string()));
        let x = p(&["--clear", "--granularity=64K", "--add", "--enable", "i", "b"]).unwrap();
        assert_eq!(x.ops, [Op::Clear, Op::Add, Op::Enable]);
        assert!(p(&["i", "b"]).unwrap_err().to_string().contains("no operation"));
        assert!(p(&["--add", "i"]).unwrap_err().to_string().contains("IMAGE BITMAP"));
        assert!(p(&["--add", "--frob", "i", "b"]).unwrap_err().to_string().contains("unknown option"));
        assert!(p(&["--remove", "-g", "4K", "i", "b"]).is_err());
        assert!(p(&["--add", "-f", "raw", "i", "b"]).is_err());
        assert!(p(&["--merge"]).is_err());
    }
}
