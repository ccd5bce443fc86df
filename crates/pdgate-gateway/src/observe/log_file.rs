//! The `--log-dir` file: `DIR/pdgate.log`, rotated daily (UTC days), as SMG rotates its log
//! files. The first line written on a new day renames the file to `pdgate.log.YYYY-MM-DD` (the
//! day it holds) and starts a fresh `pdgate.log`, so the current log always has the same name.
//! Rotated files are kept (SMG keeps them too); prune them with the usual tools.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing_subscriber::fmt::MakeWriter;

/// The file `--log-dir` writes to.
pub const LOG_FILE: &str = "pdgate.log";

const SECS_PER_DAY: u64 = 86_400;

/// `pdgate.log` in a directory, rotated when the (UTC) day changes.
pub struct DailyFile {
    dir: PathBuf,
    state: Mutex<State>,
    /// The clock (injected in tests).
    now: fn() -> SystemTime,
}

struct State {
    file: File,
    /// The day (since the epoch) the open file holds.
    day: u64,
}

fn day_of(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() / SECS_PER_DAY)
}

/// `YYYY-MM-DD` of a day since the epoch (the proleptic Gregorian calendar, H. Hinnant's
/// civil-from-days).
pub fn date(day: u64) -> String {
    let z = day as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

fn open_append(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

impl DailyFile {
    /// Opens (creating the directory when missing) `DIR/pdgate.log`.
    pub fn open(dir: &str) -> Result<Self, String> {
        Self::open_with_clock(dir, SystemTime::now)
    }

    /// [`DailyFile::open`] with a clock of the caller's.
    pub fn open_with_clock(dir: &str, now: fn() -> SystemTime) -> Result<Self, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("--log-dir {dir}: cannot create it: {e}"))?;
        let path = Path::new(dir).join(LOG_FILE);
        let file = open_append(&path).map_err(|e| format!("--log-dir: cannot write {}: {e}", path.display()))?;
        // A file left by an earlier run holds the day it was last written.
        let day = file.metadata().and_then(|m| m.modified()).map_or_else(|_| day_of(now()), day_of);
        Ok(DailyFile { dir: PathBuf::from(dir), state: Mutex::new(State { file, day }), now })
    }

    /// A free name for the file of `day`: `pdgate.log.DATE`, else `pdgate.log.DATE.N`.
    fn rotated_name(&self, day: u64) -> PathBuf {
        let base = format!("{LOG_FILE}.{}", date(day));
        let first = self.dir.join(&base);
        if !first.exists() {
            return first;
        }
        // Bounded: a directory never holds this many rotations of one day.
        (1..10_000).map(|n| self.dir.join(format!("{base}.{n}"))).find(|p| !p.exists()).unwrap_or(first)
    }

    /// Rotates when the day changed. A failed rename keeps writing to the current file
    /// (logging must never stop the gateway).
    fn rotate_if_due(&self, state: &mut State) {
        let today = day_of((self.now)());
        if today == state.day {
            return;
        }
        let current = self.dir.join(LOG_FILE);
        let target = self.rotated_name(state.day);
        if std::fs::rename(&current, &target).is_ok() {
            if let Ok(f) = open_append(&current) {
                state.file = f;
            }
        }
        state.day = today;
    }
}

/// One log line's writer: the line goes to the day's file in one locked write.
pub struct DailyWriter<'a>(&'a DailyFile);

impl Write for DailyWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut state = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        self.0.rotate_if_due(&mut state);
        state.file.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.state.lock().unwrap_or_else(|p| p.into_inner()).file.flush()
    }
}

impl<'a> MakeWriter<'a> for DailyFile {
    type Writer = DailyWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        DailyWriter(self)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use super::*;

    #[test]
    fn dates_of_days_since_the_epoch() {
        assert_eq!(date(0), "1970-01-01");
        assert_eq!(date(59), "1970-03-01");
        assert_eq!(date(11_016), "2000-02-29");
        assert_eq!(date(20_789), "2026-12-02");
    }

    static NOW_SECS: AtomicU64 = AtomicU64::new(0);
    fn test_clock() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(NOW_SECS.load(Ordering::SeqCst))
    }

    fn write_line(f: &DailyFile, line: &str) {
        f.make_writer().write_all(line.as_bytes()).unwrap();
    }

    #[test]
    fn a_new_day_renames_the_file_to_its_date_and_starts_a_fresh_one() {
        let dir = std::env::temp_dir().join(format!("pdgate-log-rotation-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let d = dir.to_str().unwrap();
        // Day 20789 (2026-12-02), late in the day; the new file's mtime is "now" (real time),
        // so start from the day the clock says by writing once first.
        NOW_SECS.store(20_789 * SECS_PER_DAY + 86_000, Ordering::SeqCst);
        let f = DailyFile::open_with_clock(d, test_clock).unwrap();
        f.state.lock().unwrap().day = 20_789;
        write_line(&f, "first day\n");
        NOW_SECS.store(20_790 * SECS_PER_DAY + 10, Ordering::SeqCst);
        write_line(&f, "second day\n");
        write_line(&f, "second day again\n");
        let old = std::fs::read_to_string(dir.join("pdgate.log.2026-12-02")).unwrap();
        let new = std::fs::read_to_string(dir.join(LOG_FILE)).unwrap();
        assert_eq!(old, "first day\n");
        assert_eq!(new, "second day\nsecond day again\n");
        // A later day whose dated name is taken gets a numbered one.
        std::fs::write(dir.join("pdgate.log.2026-12-03"), "taken").unwrap();
        NOW_SECS.store(20_791 * SECS_PER_DAY, Ordering::SeqCst);
        write_line(&f, "third day\n");
        assert_eq!(std::fs::read_to_string(dir.join("pdgate.log.2026-12-03.1")).unwrap(), new);
        assert_eq!(std::fs::read_to_string(dir.join(LOG_FILE)).unwrap(), "third day\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
