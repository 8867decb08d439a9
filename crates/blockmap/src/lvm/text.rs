//! The syntax of LVM2's text format (libdevmapper's config format), as lvm2 writes it in its
//! metadata areas and in `vgcfgbackup` files:
//!
//! ```text
//! # comment to the end of the line
//! key = 42                 integers (decimal, optional sign)
//! key = "a \"quoted\" string"   strings; \" and \\ are escapes, 'single quotes' have none
//! key = ["a", 1, "b", 2]   arrays of scalars (commas optional, as in lvm2)
//! name { key = 1  sub { ... } }   sections
//! ```
//!
//! The text ends at its end or at the first NUL byte (lvm2 stores the text NUL-terminated).
//! The parser is a small recursive-descent one with a hard nesting limit and never allocates
//! more than a small multiple of the input. It refuses what lvm2 would read ambiguously:
//! duplicate keys in one section and integers with leading zeros (lvm2 reads those as octal).

use std::collections::BTreeSet;

use super::LvmError;

/// Sections may nest this deep (lvm2's metadata uses 4 levels).
pub(crate) const MAX_DEPTH: usize = 16;

/// A scalar value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Scalar {
    Int(i64),
    Float(f64),
    Str(String),
}

/// The right-hand side of `key = ...`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    Scalar(Scalar),
    Array(Vec<Scalar>),
}

/// What a key names: a value or a section.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Body {
    Value(Value),
    Section(Vec<Entry>),
}

/// One `key = value` or `key { ... }`, with the line it starts on.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Entry {
    pub key: String,
    pub line: u32,
    pub body: Body,
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    SectionBegin,
    SectionEnd,
    ArrayBegin,
    ArrayEnd,
    Comma,
    Equals,
    Str(String),
    Word(String),
    Int(i64),
    Float(f64),
    Eof,
}

struct Lexer<'a> {
    src: &'a [u8],
    pos: usize,
    line: u32,
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)
}

fn ends_word(b: u8) -> bool {
    is_space(b)
        || matches!(
            b,
            b'#' | b'=' | b'{' | b'}' | b'[' | b']' | b',' | b'"' | b'\''
        )
}

impl<'a> Lexer<'a> {
    fn peek(&self) -> Option<u8> {
        self.src.get(self.pos).copied()
    }

    fn error(&self, reason: impl Into<String>) -> LvmError {
        LvmError::Syntax {
            line: self.line,
            reason: reason.into(),
        }
    }

    fn skip_space_and_comments(&mut self) {
        while let Some(b) = self.peek() {
            if b == b'#' {
                while self.peek().is_some_and(|b| b != b'\n') {
                    self.pos += 1;
                }
            } else if is_space(b) {
                if b == b'\n' {
                    self.line = self.line.saturating_add(1);
                }
                self.pos += 1;
            } else {
                break;
            }
        }
    }

    /// The next token. `value` says whether a value may start here (after `=`, `[` or `,`),
    /// which is where lvm2 reads digits as a number instead of as a name.
    fn next(&mut self, value: bool) -> Result<Token, LvmError> {
        self.skip_space_and_comments();
        let Some(b) = self.peek() else {
            return Ok(Token::Eof);
        };
        let single = match b {
            b'{' => Some(Token::SectionBegin),
            b'}' => Some(Token::SectionEnd),
            b'[' => Some(Token::ArrayBegin),
            b']' => Some(Token::ArrayEnd),
            b',' => Some(Token::Comma),
            b'=' => Some(Token::Equals),
            _ => None,
        };
        if let Some(t) = single {
            self.pos += 1;
            return Ok(t);
        }
        match b {
            b'"' => self.double_quoted(),
            b'\'' => self.single_quoted(),
            b'0'..=b'9' | b'+' | b'-' | b'.' if value => self.number(),
            _ => {
                let start = self.pos;
                while self.peek().is_some_and(|b| !ends_word(b)) {
                    self.pos += 1;
                }
                Ok(Token::Word(self.text(start, self.pos)))
            }
        }
    }

    fn text(&self, start: usize, end: usize) -> String {
        String::from_utf8_lossy(self.src.get(start..end).unwrap_or_default()).into_owned()
    }

    fn double_quoted(&mut self) -> Result<Token, LvmError> {
        let start_line = self.line;
        self.pos += 1;
        let mut out = Vec::new();
        loop {
            let Some(b) = self.peek() else {
                return Err(LvmError::Syntax {
                    line: start_line,
                    reason: "unterminated string".into(),
                });
            };
            self.pos += 1;
            match b {
                b'"' => break,
                b'\\' => {
                    // lvm2 skips the byte after any backslash when looking for the closing
                    // quote, but removes the backslash only before `"` and `\`.
                    let Some(next) = self.peek() else { continue };
                    self.pos += 1;
                    if next != b'"' && next != b'\\' {
                        out.push(b'\\');
                    }
                    if next == b'\n' {
                        self.line = self.line.saturating_add(1);
                    }
                    out.push(next);
                }
                b'\n' => {
                    self.line = self.line.saturating_add(1);
                    out.push(b);
                }
                _ => out.push(b),
            }
        }
        Ok(Token::Str(String::from_utf8_lossy(&out).into_owned()))
    }

    fn single_quoted(&mut self) -> Result<Token, LvmError> {
        let start_line = self.line;
        self.pos += 1;
        let start = self.pos;
        loop {
            match self.peek() {
                None => {
                    return Err(LvmError::Syntax {
                        line: start_line,
                        reason: "unterminated string".into(),
                    });
                }
                Some(b'\'') => break,
                Some(b) => {
                    if b == b'\n' {
                        self.line = self.line.saturating_add(1);
                    }
                    self.pos += 1;
                }
            }
        }
        let s = self.text(start, self.pos);
        self.pos += 1;
        Ok(Token::Str(s))
    }

    /// `[+-]?[0-9]*(\.[0-9]*)?` as lvm2 reads it; then a delimiter must follow.
    fn number(&mut self) -> Result<Token, LvmError> {
        let start = self.pos;
        let mut dot = self.peek() == Some(b'.');
        self.pos += 1;
        while let Some(b) = self.peek() {
            if b.is_ascii_digit() {
                self.pos += 1;
            } else if b == b'.' && !dot {
                dot = true;
                self.pos += 1;
            } else {
                break;
            }
        }
        let token = self.text(start, self.pos);
        if self.peek().is_some_and(|b| !ends_word(b)) {
            return Err(self.error(format!("malformed number starting {token:?}")));
        }
        if dot {
            return token
                .parse::<f64>()
                .map(Token::Float)
                .map_err(|_| self.error(format!("malformed number {token:?}")));
        }
        let digits = token.trim_start_matches(['+', '-']);
        if digits.is_empty() || token.len() - digits.len() > 1 {
            return Err(self.error(format!("malformed number {token:?}")));
        }
        if digits.len() > 1 && digits.starts_with('0') {
            return Err(self.error(format!(
                "number {token:?} has a leading zero (lvm2 would read it as octal)"
            )));
        }
        token
            .parse::<i64>()
            .map(Token::Int)
            .map_err(|_| self.error(format!("number {token:?} does not fit in 64 bits")))
    }
}

struct Parser<'a> {
    lex: Lexer<'a>,
    token: Token,
}

impl Parser<'_> {
    /// Moves to the next token; `value` as in [`Lexer::next`].
    fn advance(&mut self, value: bool) -> Result<(), LvmError> {
        self.token = self.lex.next(value)?;
        Ok(())
    }

    fn describe(token: &Token) -> String {
        match token {
            Token::SectionBegin => "'{'".into(),
            Token::SectionEnd => "'}'".into(),
            Token::ArrayBegin => "'['".into(),
            Token::ArrayEnd => "']'".into(),
            Token::Comma => "','".into(),
            Token::Equals => "'='".into(),
            Token::Str(s) => format!("string {s:?}"),
            Token::Word(w) => format!("{w:?}"),
            Token::Int(i) => format!("number {i}"),
            Token::Float(f) => format!("number {f}"),
            Token::Eof => "end of text".into(),
        }
    }

    fn unexpected(&self, wanted: &str) -> LvmError {
        self.lex.error(format!(
            "expected {wanted}, found {}",
            Self::describe(&self.token)
        ))
    }

    /// Entries until `}` (when `depth > 0`) or the end of the text (at depth 0).
    fn entries(&mut self, depth: usize) -> Result<Vec<Entry>, LvmError> {
        let mut entries: Vec<Entry> = Vec::new();
        let mut seen: BTreeSet<String> = BTreeSet::new();
        loop {
            let key = match &self.token {
                Token::Eof if depth == 0 => return Ok(entries),
                Token::SectionEnd if depth > 0 => return Ok(entries),
                Token::Word(w) | Token::Str(w) if !w.is_empty() => w.clone(),
                _ => return Err(self.unexpected("a key or a section name")),
            };
            let line = self.lex.line;
            if !seen.insert(key.clone()) {
                return Err(self.lex.error(format!("duplicate key {key:?}")));
            }
            self.advance(false)?;
            let body = match self.token {
                Token::SectionBegin => {
                    if depth + 1 > MAX_DEPTH {
                        return Err(LvmError::TooDeep {
                            line,
                            max: MAX_DEPTH,
                        });
                    }
                    self.advance(false)?;
                    let children = self.entries(depth + 1)?;
                    // entries() returned at '}'.
                    self.advance(false)?;
                    Body::Section(children)
                }
                Token::Equals => {
                    self.advance(true)?;
                    Body::Value(self.value()?)
                }
                _ => return Err(self.unexpected("'=' or '{'")),
            };
            entries.push(Entry { key, line, body });
        }
    }

    fn scalar(&mut self) -> Result<Scalar, LvmError> {
        let s = match std::mem::replace(&mut self.token, Token::Eof) {
            Token::Int(i) => Scalar::Int(i),
            Token::Float(f) => Scalar::Float(f),
            Token::Str(s) | Token::Word(s) => Scalar::Str(s),
            other => {
                self.token = other;
                return Err(self.unexpected("a value"));
            }
        };
        Ok(s)
    }

    /// A value; on return the current token is the one after it.
    fn value(&mut self) -> Result<Value, LvmError> {
        if self.token != Token::ArrayBegin {
            let s = self.scalar()?;
            self.advance(false)?;
            return Ok(Value::Scalar(s));
        }
        self.advance(true)?;
        let mut items = Vec::new();
        while self.token != Token::ArrayEnd {
            items.push(self.scalar()?);
            // As in lvm2, only a ',' puts the lexer back in value position; without one the
            // next item must be a quoted string (a bare word there is a name, not a value).
            self.advance(false)?;
            match self.token {
                Token::Comma => self.advance(true)?,
                Token::Word(_) => {
                    return Err(self
                        .lex
                        .error("array items must be separated by ',' unless quoted"));
                }
                _ => {}
            }
        }
        self.advance(false)?;
        Ok(Value::Array(items))
    }
}

/// Parses LVM2 config text into its top-level entries.
pub(crate) fn parse(src: &[u8]) -> Result<Vec<Entry>, LvmError> {
    let end = src.iter().position(|&b| b == 0).unwrap_or(src.len());
    let src = src.get(..end).unwrap_or_default();
    let mut lex = Lexer {
        src,
        pos: 0,
        line: 1,
    };
    let token = lex.next(false)?;
    let mut parser = Parser { lex, token };
    parser.entries(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int(i: i64) -> Body {
        Body::Value(Value::Scalar(Scalar::Int(i)))
    }

    fn string(s: &str) -> Body {
        Body::Value(Value::Scalar(Scalar::Str(s.into())))
    }

    fn keys(entries: &[Entry]) -> Vec<&str> {
        entries.iter().map(|e| e.key.as_str()).collect()
    }

    #[test]
    fn parses_values_sections_and_arrays() {
        let text = br#"
# Generated by LVM2
contents = "Text Format Volume Group"
version = 1
neg = -7
plus = +7
zero = 0
float = 1.5
bare = lvm2	# informational
vg0 {
	id = "abc"
	empty = []
	status = ["READ", "WRITE"]
	stripes = [
		"pv0", 0,
		"pv1", 128
	]
	nocommas = ["a" "b"]
	sub { deeper { x = 'single \ quoted' } }
}
"#;
        let e = parse(text).unwrap();
        assert_eq!(
            keys(&e),
            [
                "contents", "version", "neg", "plus", "zero", "float", "bare", "vg0"
            ]
        );
        assert_eq!(e[0].body, string("Text Format Volume Group"));
        assert_eq!(e[0].line, 3);
        assert_eq!(e[1].body, int(1));
        assert_eq!(e[2].body, int(-7));
        assert_eq!(e[3].body, int(7));
        assert_eq!(e[4].body, int(0));
        assert_eq!(e[5].body, Body::Value(Value::Scalar(Scalar::Float(1.5))));
        assert_eq!(e[6].body, string("lvm2"));
        let Body::Section(vg) = &e[7].body else {
            panic!("not a section")
        };
        assert_eq!(
            keys(vg),
            ["id", "empty", "status", "stripes", "nocommas", "sub"]
        );
        assert_eq!(vg[1].body, Body::Value(Value::Array(vec![])));
        assert_eq!(
            vg[3].body,
            Body::Value(Value::Array(vec![
                Scalar::Str("pv0".into()),
                Scalar::Int(0),
                Scalar::Str("pv1".into()),
                Scalar::Int(128)
            ]))
        );
        assert_eq!(
            vg[4].body,
            Body::Value(Value::Array(vec![
                Scalar::Str("a".into()),
                Scalar::Str("b".into())
            ]))
        );
        let Body::Section(sub) = &vg[5].body else {
            panic!("not a section")
        };
        let Body::Section(deeper) = &sub[0].body else {
            panic!("not a section")
        };
        assert_eq!(deeper[0].body, string("single \\ quoted"));
    }

    #[test]
    fn string_escapes_follow_lvm2() {
        let e = parse(br#"a = "q\"b\\s\n""#).unwrap();
        assert_eq!(e[0].body, string("q\"b\\s\\n"));
        // Keys may be quoted (lvm2 quotes keys holding '#', '"' or '!').
        let e = parse(br#""we#ird" = 1"#).unwrap();
        assert_eq!(e[0].key, "we#ird");
    }

    #[test]
    fn text_ends_at_nul_and_lines_are_counted() {
        let e = parse(b"a = 1\n\0garbage {{{").unwrap();
        assert_eq!(keys(&e), ["a"]);
        let err = parse(b"a = 1\n\nb = \n}").unwrap_err();
        assert_eq!(
            err,
            LvmError::Syntax {
                line: 4,
                reason: "expected a value, found '}'".into()
            }
        );
    }

    #[test]
    fn malformed_text_is_refused() {
        let cases: &[&[u8]] = &[
            b"a = ",
            b"a 1",
            b"a = \"open",
            b"a = 'open",
            b"a = [1, 2",
            b"a = [1 2]",
            b"a { b = 1",
            b"}",
            b"a = 1 }",
            b"= 1",
            b"a = 12abc",
            b"a = 010",
            b"a = 99999999999999999999",
            b"a = +",
            b"a = --1",
            b"a = 1..2",
            b"a = [[1]]",
            b"a = {",
            b"a = 1\na = 2",
            b"s { a = 1 }\ns { b = 1 }",
            b"\"\" = 1",
        ];
        for &case in cases {
            let r = parse(case);
            assert!(
                matches!(r, Err(LvmError::Syntax { .. })),
                "{:?} gave {r:?}",
                String::from_utf8_lossy(case)
            );
        }
    }

    #[test]
    fn nesting_is_bounded() {
        let ok = "a {".repeat(MAX_DEPTH) + &"}".repeat(MAX_DEPTH);
        assert!(parse(ok.as_bytes()).is_ok());
        let deep = "a {".repeat(MAX_DEPTH + 1) + &"}".repeat(MAX_DEPTH + 1);
        assert!(matches!(
            parse(deep.as_bytes()),
            Err(LvmError::TooDeep { .. })
        ));
        // A hostile input far deeper than the limit fails fast, without recursion blow-up.
        let hostile = "a{".repeat(1_000_000);
        assert!(matches!(
            parse(hostile.as_bytes()),
            Err(LvmError::TooDeep { .. })
        ));
    }

    #[test]
    fn many_keys_in_one_section_parse_in_near_linear_time() {
        // A duplicate-key check that compared every pair would take minutes here.
        let text: String = (0..200_000).map(|i| format!("k{i} = {i}\n")).collect();
        let entries = parse(text.as_bytes()).unwrap();
        assert_eq!(entries.len(), 200_000);
        assert_eq!(entries[199_999].body, int(199_999));
    }

    #[test]
    fn non_utf8_bytes_in_strings_do_not_fail_parsing() {
        let e = parse(b"description = \"caf\xe9\"").unwrap();
        assert_eq!(e[0].body, string("caf\u{fffd}"));
    }
}
