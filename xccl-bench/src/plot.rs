//! `--plot`: a PNG of a sweep, p50 latency (left) and algorithm bandwidth (right) against tokens,
//! one line per operation. Drawn by hand (a 3x5 pixel font, an uncompressed PNG writer) so the
//! benchmark needs no font or image library.

use std::path::Path;

use crate::report::{ResultRow, OPS};

const W: usize = 960;
const H: usize = 420;
const COLORS: [[u8; 3]; 3] = [[31, 119, 180], [214, 39, 40], [44, 160, 44]];

struct Canvas {
    px: Vec<u8>,
}

impl Canvas {
    fn new() -> Self {
        Canvas {
            px: vec![255; W * H * 3],
        }
    }

    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if (0..W as i64).contains(&x) && (0..H as i64).contains(&y) {
            let i = (y as usize * W + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }

    fn rect(&mut self, x: i64, y: i64, w: i64, h: i64, c: [u8; 3]) {
        for yy in y..y + h {
            for xx in x..x + w {
                self.set(xx, yy, c);
            }
        }
    }

    /// A line `thick` pixels wide (Bresenham with a square pen).
    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), c: [u8; 3], thick: i64) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            self.rect(x - thick / 2, y - thick / 2, thick, thick, c);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Text in the 3x5 font, scaled by 2; unknown characters are blank.
    fn text(&mut self, x: i64, y: i64, s: &str, c: [u8; 3]) {
        const SCALE: i64 = 2;
        for (i, ch) in s.chars().enumerate() {
            let rows = glyph(ch.to_ascii_uppercase());
            for (r, bits) in rows.iter().enumerate() {
                for b in 0..3 {
                    if bits & (4 >> b) != 0 {
                        let px = x + (i as i64 * 4 + b) * SCALE;
                        self.rect(px, y + r as i64 * SCALE, SCALE, SCALE, c);
                    }
                }
            }
        }
    }

    fn text_width(s: &str) -> i64 {
        s.chars().count() as i64 * 8
    }
}

/// Rows (3 bits each, MSB left) of a 3x5 glyph.
fn glyph(c: char) -> [u8; 5] {
    match c {
        '0' => [7, 5, 5, 5, 7],
        '1' => [2, 6, 2, 2, 7],
        '2' => [7, 1, 7, 4, 7],
        '3' => [7, 1, 3, 1, 7],
        '4' => [5, 5, 7, 1, 1],
        '5' => [7, 4, 7, 1, 7],
        '6' => [7, 4, 7, 5, 7],
        '7' => [7, 1, 1, 2, 2],
        '8' => [7, 5, 7, 5, 7],
        '9' => [7, 5, 7, 1, 7],
        'A' => [2, 5, 7, 5, 5],
        'B' => [6, 5, 6, 5, 6],
        'C' => [3, 4, 4, 4, 3],
        'D' => [6, 5, 5, 5, 6],
        'E' => [7, 4, 6, 4, 7],
        'F' => [7, 4, 6, 4, 4],
        'G' => [3, 4, 5, 5, 3],
        'H' => [5, 5, 7, 5, 5],
        'I' => [7, 2, 2, 2, 7],
        'K' => [5, 5, 6, 5, 5],
        'L' => [4, 4, 4, 4, 7],
        'M' => [5, 7, 7, 5, 5],
        'N' => [6, 5, 5, 5, 5],
        'O' => [2, 5, 5, 5, 2],
        'P' => [6, 5, 6, 4, 4],
        'R' => [6, 5, 6, 5, 5],
        'S' => [3, 4, 2, 1, 6],
        'T' => [7, 2, 2, 2, 2],
        'U' => [5, 5, 5, 5, 7],
        'W' => [5, 5, 7, 7, 5],
        'X' => [5, 5, 2, 5, 5],
        'Y' => [5, 5, 2, 2, 2],
        '.' => [0, 0, 0, 0, 2],
        ',' => [0, 0, 0, 2, 4],
        ':' => [0, 2, 0, 2, 0],
        '-' => [0, 0, 7, 0, 0],
        '/' => [1, 1, 2, 4, 4],
        '(' => [1, 2, 2, 2, 1],
        ')' => [4, 2, 2, 2, 4],
        '=' => [0, 7, 0, 7, 0],
        _ => [0; 5],
    }
}

/// A short number label: 3 significant digits at most.
fn fmt_num(v: f64) -> String {
    if v >= 100.0 || v == 0.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Draws one panel: `value` of each row against tokens.
fn panel(cv: &mut Canvas, x0: i64, rows: &[ResultRow], title: &str, value: fn(&ResultRow) -> f64) {
    let (left, top, w, h) = (x0 + 70, 50i64, 360i64, 300i64);
    let black = [0, 0, 0];
    let grey = [200, 200, 200];
    cv.text(left + (w - Canvas::text_width(title)) / 2, 20, title, black);
    let mut tokens: Vec<usize> = rows.iter().map(|r| r.tokens).collect();
    tokens.sort_unstable();
    tokens.dedup();
    let log = |t: usize| (t.max(1) as f64).log2();
    let (tmin, tmax) = (
        log(tokens[0]),
        log(*tokens.last().expect("one token count")),
    );
    let xpos = |t: usize| {
        if tmax > tmin {
            left + ((log(t) - tmin) / (tmax - tmin) * w as f64) as i64
        } else {
            left + w / 2
        }
    };
    let vmax = rows.iter().map(value).fold(0.0, f64::max).max(1e-9) * 1.1;
    let ypos = |v: f64| top + h - (v / vmax * h as f64) as i64;
    for i in 0..=4 {
        let v = vmax * i as f64 / 4.0;
        let y = ypos(v);
        cv.line((left, y), (left + w, y), grey, 1);
        let label = fmt_num(v);
        cv.text(left - 8 - Canvas::text_width(&label), y - 5, &label, black);
    }
    for &t in &tokens {
        let x = xpos(t);
        cv.line((x, top + h), (x, top + h + 5), black, 1);
        let label = t.to_string();
        cv.text(
            x - Canvas::text_width(&label) / 2,
            top + h + 10,
            &label,
            black,
        );
    }
    cv.line((left, top), (left, top + h), black, 2);
    cv.line((left, top + h), (left + w, top + h), black, 2);
    cv.text(left + w / 2 - 24, top + h + 30, "TOKENS", black);
    for (op, c) in OPS.iter().zip(COLORS) {
        let mut pts: Vec<(i64, i64)> = rows
            .iter()
            .filter(|r| r.op == *op)
            .map(|r| (xpos(r.tokens), ypos(value(r))))
            .collect();
        pts.sort_unstable();
        for p in &pts {
            cv.rect(p.0 - 3, p.1 - 3, 7, 7, c);
        }
        for pair in pts.windows(2) {
            cv.line(pair[0], pair[1], c, 2);
        }
    }
}

/// Renders the sweep and writes it as a PNG.
pub fn write(path: &Path, rows: &[ResultRow], subtitle: &str) -> std::io::Result<()> {
    let mut cv = Canvas::new();
    if !rows.is_empty() {
        panel(&mut cv, 0, rows, "P50 LATENCY (US)", |r| r.p50_us);
        panel(&mut cv, 480, rows, "ALGBW (GB/S)", |r| r.algbw_gbps);
    }
    let mut x = 80;
    for (op, c) in OPS.iter().zip(COLORS) {
        cv.rect(x, H as i64 - 22, 14, 10, c);
        cv.text(x + 20, H as i64 - 22, op, [0, 0, 0]);
        x += 40 + Canvas::text_width(op);
    }
    cv.text(x + 20, H as i64 - 22, subtitle, [90, 90, 90]);
    std::fs::write(path, encode_png(&cv.px, W, H))
}

/// An RGB8 PNG with zlib "stored" (uncompressed) blocks.
pub fn encode_png(rgb: &[u8], w: usize, h: usize) -> Vec<u8> {
    let mut raw = Vec::with_capacity((w * 3 + 1) * h);
    for row in rgb.chunks_exact(w * 3) {
        raw.push(0); // filter: none
        raw.extend_from_slice(row);
    }
    let mut z = vec![0x78, 0x01];
    let mut chunks = raw.chunks(65_535).peekable();
    while let Some(block) = chunks.next() {
        z.push(u8::from(chunks.peek().is_none()));
        let len = block.len() as u16;
        z.extend_from_slice(&len.to_le_bytes());
        z.extend_from_slice(&(!len).to_le_bytes());
        z.extend_from_slice(block);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &byte in &raw {
        a = (a + u32::from(byte)) % 65_521;
        b = (b + a) % 65_521;
    }
    z.extend_from_slice(&((b << 16) | a).to_be_bytes());
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&(w as u32).to_be_bytes());
    ihdr.extend_from_slice(&(h as u32).to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(&mut png, b"IHDR", &ihdr);
    chunk(&mut png, b"IDAT", &z);
    chunk(&mut png, b"IEND", &[]);
    png
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = 0xffff_ffffu32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xedb8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_of_iend_matches_the_png_spec() {
        assert_eq!(crc32(b"IEND"), 0xae42_6082);
    }
}
