//! PNG line charts in the style of the paper's figures (plotters' bitmap backend).
//!
//! Text is drawn with a built-in 8x8 bitmap font (`font8x8`, scaled by whole pixels) through
//! a thin wrapper backend, so the plots need neither system fonts nor any C library: the
//! bench draws the same pictures on a bare server as on a desktop.

use std::path::Path;

use anyhow::Context;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters_backend::FontTransform;
use plotters_backend::text_anchor::{HPos, VPos};
use plotters_backend::{
    BackendColor, BackendCoord, BackendStyle, BackendTextStyle, DrawingBackend, DrawingErrorKind,
};

/// Pixels of one glyph cell of the built-in font.
const GLYPH: i32 = 8;

/// A bitmap backend whose text is the built-in bitmap font.
struct BitmapText<'a> {
    inner: BitMapBackend<'a>,
}

/// Whole-pixel scale of the 8x8 font for a requested font size.
fn scale_for(size: f64) -> i32 {
    ((size / 10.0).round() as i32).clamp(1, 6)
}

impl<'a> DrawingBackend for BitmapText<'a> {
    type ErrorType = <BitMapBackend<'a> as DrawingBackend>::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.inner.get_size()
    }

    fn ensure_prepared(&mut self) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.ensure_prepared()
    }

    fn present(&mut self) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.present()
    }

    fn draw_pixel(
        &mut self,
        point: BackendCoord,
        color: BackendColor,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_pixel(point, color)
    }

    fn draw_line<S: BackendStyle>(
        &mut self,
        from: BackendCoord,
        to: BackendCoord,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_line(from, to, style)
    }

    fn draw_rect<S: BackendStyle>(
        &mut self,
        upper_left: BackendCoord,
        bottom_right: BackendCoord,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_rect(upper_left, bottom_right, style, fill)
    }

    fn draw_path<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        path: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_path(path, style)
    }

    fn draw_circle<S: BackendStyle>(
        &mut self,
        center: BackendCoord,
        radius: u32,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_circle(center, radius, style, fill)
    }

    fn fill_polygon<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        vert: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.fill_polygon(vert, style)
    }

    fn estimate_text_size<TStyle: BackendTextStyle>(
        &self,
        text: &str,
        style: &TStyle,
    ) -> Result<(u32, u32), DrawingErrorKind<Self::ErrorType>> {
        let s = scale_for(style.size());
        let w = text.chars().count() as i32 * GLYPH * s;
        Ok((w.max(0) as u32, (GLYPH * s) as u32))
    }

    fn draw_text<TStyle: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &TStyle,
        pos: BackendCoord,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        let s = scale_for(style.size());
        let color = style.color();
        let w = text.chars().count() as i32 * GLYPH * s;
        let h = GLYPH * s;
        let anchor = style.anchor();
        let dx = match anchor.h_pos {
            HPos::Left => 0,
            HPos::Center => -w / 2,
            HPos::Right => -w,
        };
        let dy = match anchor.v_pos {
            VPos::Top => 0,
            VPos::Center => -h / 2,
            VPos::Bottom => -h,
        };
        let transform = style.transform();
        for (i, c) in text.chars().enumerate() {
            let code = if c.is_ascii() {
                c as usize
            } else {
                b'?' as usize
            };
            let glyph = font8x8::legacy::BASIC_LEGACY[code];
            for (row, bits) in glyph.iter().enumerate() {
                for col in 0..8 {
                    if bits & (1 << col) == 0 {
                        continue;
                    }
                    for sy in 0..s {
                        for sx in 0..s {
                            let x = dx + (i as i32 * GLYPH + col) * s + sx;
                            let y = dy + row as i32 * s + sy;
                            let (rx, ry) = rotate(&transform, x, y);
                            self.inner.draw_pixel((pos.0 + rx, pos.1 + ry), color)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

fn rotate(t: &FontTransform, x: i32, y: i32) -> (i32, i32) {
    match t {
        FontTransform::None => (x, y),
        FontTransform::Rotate90 => (-y, x),
        FontTransform::Rotate180 => (-x, -y),
        FontTransform::Rotate270 => (y, -x),
    }
}

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed (the paper's dotted and dash-dot lines are references).
    pub dashed: bool,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points,
            dashed: false,
        }
    }

    pub fn dashed(mut self) -> Series {
        self.dashed = true;
        self
    }
}

/// How the x axis is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XAxis {
    /// I/O sizes in bytes on a log2 scale, labelled 4K, 64K, 1M.
    Log2Bytes,
    /// Plain counts (LUNs, processes).
    Linear,
}

/// A chart: title, axes, lines.
#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub x_axis: XAxis,
    pub series: Vec<Series>,
}

const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 0, 0),
    RGBColor(200, 30, 30),
    RGBColor(30, 90, 200),
    RGBColor(20, 140, 60),
    RGBColor(160, 60, 170),
    RGBColor(220, 130, 0),
    RGBColor(90, 90, 90),
];

/// Draws `chart` into a PNG at `path` (800 x 520).
pub fn draw(chart: &Chart, path: &Path) -> anyhow::Result<()> {
    let backend = BitmapText {
        inner: BitMapBackend::new(path, (800, 520)),
    };
    let root = backend.into_drawing_area();
    draw_on(chart, &root).map_err(|e| anyhow::anyhow!("draw {}: {e}", path.display()))?;
    root.present()
        .map_err(|e| anyhow::anyhow!("write {}: {e}", path.display()))
        .with_context(|| format!("plot {}", chart.title))
}

fn draw_on<DB: DrawingBackend>(
    chart: &Chart,
    root: &DrawingArea<DB, Shift>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let pts = chart.series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y1) = (f64::MAX, f64::MIN, 0.0f64);
    for &(x, y) in pts {
        let x = if chart.x_axis == XAxis::Log2Bytes {
            x.max(1.0).log2()
        } else {
            x
        };
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 - x0 < 1e-9 {
        x1 = x0 + 1.0;
    }
    let y1 = if y1 <= 0.0 { 1.0 } else { y1 * 1.1 };
    let pad = if chart.x_axis == XAxis::Linear {
        0.3
    } else {
        0.2
    };
    let mut ctx = ChartBuilder::on(root)
        .caption(&chart.title, ("sans-serif", 20))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(80)
        .build_cartesian_2d((x0 - pad)..(x1 + pad), 0.0..y1)?;
    let log2 = chart.x_axis == XAxis::Log2Bytes;
    let x_fmt = move |x: &f64| {
        if log2 {
            crate::util::size_label(2f64.powf(x.round()) as u64)
        } else {
            format!("{}", x.round() as i64)
        }
    };
    let x_ticks = ((x1 - x0).round() as usize + 1).clamp(2, 13);
    ctx.configure_mesh()
        .x_desc(chart.x_label.as_str())
        .y_desc(chart.y_label.as_str())
        .x_labels(x_ticks)
        .y_labels(8)
        .x_label_formatter(&x_fmt)
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 14))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    for (i, s) in chart.series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let points: Vec<(f64, f64)> = s
            .points
            .iter()
            .map(|&(x, y)| (if log2 { x.max(1.0).log2() } else { x }, y))
            .collect();
        let style = ShapeStyle::from(&color).stroke_width(2);
        let drawn = if s.dashed {
            ctx.draw_series(DashedLineSeries::new(points.clone(), 8, 5, style))?
        } else {
            ctx.draw_series(LineSeries::new(points.clone(), style))?
        };
        drawn.label(s.name.as_str()).legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + 24, y)], Color::stroke_width(&color, 2))
        });
        ctx.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    ctx.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png_without_fonts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.png");
        let chart = Chart {
            title: "Figure 6: read".into(),
            x_label: "I/O size".into(),
            y_label: "MB/s".into(),
            x_axis: XAxis::Log2Bytes,
            series: vec![
                Series::new("raw", vec![(4096.0, 100.0), (1048576.0, 900.0)]),
                Series::new("nfs", vec![(4096.0, 50.0), (1048576.0, 300.0)]).dashed(),
            ],
        };
        draw(&chart, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(bytes.len() > 2000, "a chart with text and lines");
    }
}
