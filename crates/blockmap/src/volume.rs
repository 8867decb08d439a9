//! Volumes: how the blocks of one file system are laid over its LUNs.
//!
//! Every layout, linear concatenation, striping, or an imported LVM2 logical volume, is
//! expressed the same way: a sorted list of [`Segment`]s that together cover the volume's byte
//! address space from 0 without gaps. A segment is striped round-robin over one or more
//! [`StripeLeg`]s in units of its `stripe_unit`; a segment with one leg is a plain linear
//! mapping. This is exactly LVM2's model (a `striped` segment with `stripe_count` 1 is linear),
//! so one mapping routine serves all three layouts.
//!
//! Devices are identified by their UUID (sanfs label or LVM PV UUID), never by path. A
//! [`DeviceIndex`] is a device's position in [`Volume::devices`].

use std::fmt;

use uuid::Uuid;

/// Position of a device (LUN) in its volume's device list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceIndex(pub u32);

impl fmt::Display for DeviceIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "d{}", self.0)
    }
}

impl DeviceIndex {
    /// The index as a `usize`, for indexing per-device arrays.
    pub fn as_usize(self) -> usize {
        self.0 as usize
    }
}

/// An LVM2 PV UUID: 32 characters from `[0-9A-Za-z]`, shown as 6-4-4-4-4-4-6 groups with
/// hyphens (`lvm2`'s `id_write_format`). It is not an RFC 4122 UUID.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LvmPvId([u8; 32]);

impl LvmPvId {
    /// Parses the hyphenated or the bare 32-character form.
    pub fn parse(text: &str) -> Option<LvmPvId> {
        let mut id = [0u8; 32];
        let mut n = 0;
        for b in text.bytes().filter(|&b| b != b'-') {
            if !b.is_ascii_alphanumeric() || n == 32 {
                return None;
            }
            id[n] = b;
            n += 1;
        }
        (n == 32).then_some(LvmPvId(id))
    }

    /// The 32 bare characters, as stored in the PV label.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for LvmPvId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut start = 0;
        for (i, group) in [6usize, 4, 4, 4, 4, 4, 6].into_iter().enumerate() {
            if i > 0 {
                f.write_str("-")?;
            }
            for &b in &self.0[start..start + group] {
                write!(f, "{}", char::from(b))?;
            }
            start += group;
        }
        Ok(())
    }
}

impl fmt::Debug for LvmPvId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LvmPvId({self})")
    }
}

/// How a LUN is identified: by the UUID in its sanfs label, or by its LVM2 PV UUID. Never by
/// path, because paths differ from node to node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeviceId {
    Sanfs(Uuid),
    LvmPv(LvmPvId),
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceId::Sanfs(u) => write!(f, "{u}"),
            DeviceId::LvmPv(p) => write!(f, "lvm:{p}"),
        }
    }
}

/// One LUN of a volume, as the volume knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeDevice {
    /// The UUID in the device's sanfs label, or its LVM PV UUID.
    pub uuid: DeviceId,
    /// Size of the whole device in bytes (labels included).
    pub size_bytes: u64,
}

/// One column of a segment: the device and the physical byte offset where the column starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StripeLeg {
    pub device: DeviceIndex,
    pub phys_start: u64,
}

/// A run of volume bytes `[vol_start, vol_start + len)` laid round-robin over `legs` in units
/// of `stripe_unit` bytes. With one leg the segment is linear and `stripe_unit` only has to be
/// a positive multiple of the block size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub vol_start: u64,
    pub len: u64,
    pub stripe_unit: u64,
    pub legs: Vec<StripeLeg>,
}

impl Segment {
    /// End of the segment in volume bytes (exclusive).
    pub fn vol_end(&self) -> u64 {
        self.vol_start + self.len
    }

    /// Bytes each leg holds.
    pub fn leg_len(&self) -> u64 {
        self.len / self.legs.len() as u64
    }

    /// Map `off` (inside this segment) to a physical run, at most `max_len` long and never
    /// crossing a stripe-unit boundary.
    fn map_one(&self, off: u64, max_len: u64) -> PhysRun {
        let rel = off - self.vol_start;
        let width = self.legs.len() as u64;
        if width == 1 {
            let leg = self.legs[0];
            let len = max_len.min(self.vol_end() - off);
            return PhysRun {
                vol_off: off,
                device: leg.device,
                phys_off: leg.phys_start + rel,
                len,
            };
        }
        let su = self.stripe_unit;
        let stripe_no = rel / su;
        let within = rel % su;
        let leg = self.legs[(stripe_no % width) as usize];
        let row = stripe_no / width;
        PhysRun {
            vol_off: off,
            device: leg.device,
            phys_off: leg.phys_start + row * su + within,
            len: max_len.min(su - within),
        }
    }
}

/// What kind of layout a volume was built from (for display and for the allocator's choices;
/// the mapping itself only looks at the segments).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutKind {
    /// Devices concatenated in order.
    Linear,
    /// One segment striped over all devices.
    Striped { stripe_unit: u64, width: u32 },
    /// The segments of an imported LVM2 logical volume.
    Lvm { vg_name: String, lv_name: String },
}

/// A contiguous piece of a volume range on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhysRun {
    /// Volume byte offset where this run starts.
    pub vol_off: u64,
    pub device: DeviceIndex,
    pub phys_off: u64,
    pub len: u64,
}

/// A byte range of one device, without the volume offset it came from
/// ([`Volume::device_ranges`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct DeviceRange {
    pub device: DeviceIndex,
    pub phys_off: u64,
    pub len: u64,
}

/// `ranges` sorted by device and offset, empty ones dropped, and those that touch or overlap
/// on one device merged into one.
pub fn merge_device_ranges(mut ranges: Vec<DeviceRange>) -> Vec<DeviceRange> {
    ranges.retain(|r| r.len > 0);
    ranges.sort_unstable();
    let mut merged: Vec<DeviceRange> = Vec::with_capacity(ranges.len());
    for r in ranges {
        if let Some(last) = merged.last_mut()
            && last.device == r.device
            && last.phys_off.saturating_add(last.len) >= r.phys_off
        {
            let end = last
                .phys_off
                .saturating_add(last.len)
                .max(r.phys_off.saturating_add(r.len));
            last.len = end - last.phys_off;
            continue;
        }
        merged.push(r);
    }
    merged
}

/// Why a volume could not be built or a range not mapped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VolumeError {
    #[error("a volume needs at least one device")]
    NoDevices,
    #[error("too many devices: {0} (at most {max})", max = u32::MAX)]
    TooManyDevices(usize),
    #[error("block size {0} is not a power of two from 512 to 65536")]
    BadBlockSize(u32),
    #[error("stripe unit {stripe_unit} is not a positive multiple of the block size {block_size}")]
    BadStripeUnit { stripe_unit: u64, block_size: u32 },
    #[error("device {uuid} appears twice in the volume")]
    DuplicateDevice { uuid: DeviceId },
    #[error(
        "device {index} ({uuid}) is too small: {size_bytes} bytes, data would start at {data_offset}"
    )]
    DeviceTooSmall {
        index: DeviceIndex,
        uuid: DeviceId,
        size_bytes: u64,
        data_offset: u64,
    },
    #[error("segment {index}: {reason}")]
    BadSegment { index: usize, reason: String },
    #[error("range {offset}+{len} lies outside the volume of {size} bytes")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("not a growth of the volume: {0}")]
    NotAGrowth(String),
}

/// The LUNs of one file system and how its blocks are laid over them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    block_size: u32,
    devices: Vec<VolumeDevice>,
    segments: Vec<Segment>,
    kind: LayoutKind,
}

fn check_block_size(block_size: u32) -> Result<(), VolumeError> {
    if block_size.is_power_of_two() && (512..=65536).contains(&block_size) {
        Ok(())
    } else {
        Err(VolumeError::BadBlockSize(block_size))
    }
}

/// Usable bytes of a device after `data_offset`, rounded down to `unit`.
fn usable(
    index: usize,
    dev: &VolumeDevice,
    data_offset: u64,
    unit: u64,
) -> Result<u64, VolumeError> {
    let avail = dev.size_bytes.saturating_sub(data_offset);
    let usable = avail - avail % unit;
    if usable == 0 {
        return Err(VolumeError::DeviceTooSmall {
            index: DeviceIndex(index as u32),
            uuid: dev.uuid,
            size_bytes: dev.size_bytes,
            data_offset,
        });
    }
    Ok(usable)
}

impl Volume {
    /// Devices concatenated in order, each contributing its bytes from `data_offset` on (the
    /// space before it holds the device's label), rounded down to whole blocks.
    pub fn linear(
        block_size: u32,
        devices: Vec<VolumeDevice>,
        data_offset: u64,
    ) -> Result<Volume, VolumeError> {
        check_block_size(block_size)?;
        let mut segments = Vec::with_capacity(devices.len());
        let mut vol_start = 0u64;
        for (i, dev) in devices.iter().enumerate() {
            let len = usable(i, dev, data_offset, u64::from(block_size))?;
            segments.push(Segment {
                vol_start,
                len,
                stripe_unit: u64::from(block_size),
                legs: vec![StripeLeg {
                    device: DeviceIndex(i as u32),
                    phys_start: data_offset,
                }],
            });
            vol_start += len;
        }
        Volume::from_segments(block_size, devices, segments, LayoutKind::Linear)
    }

    /// One segment striped over all devices in units of `stripe_unit` bytes. Every device
    /// contributes as many bytes as the smallest one (after `data_offset`), rounded down to
    /// whole stripe units.
    pub fn striped(
        block_size: u32,
        devices: Vec<VolumeDevice>,
        data_offset: u64,
        stripe_unit: u64,
    ) -> Result<Volume, VolumeError> {
        check_block_size(block_size)?;
        if stripe_unit == 0 || !stripe_unit.is_multiple_of(u64::from(block_size)) {
            return Err(VolumeError::BadStripeUnit {
                stripe_unit,
                block_size,
            });
        }
        let mut leg_len = u64::MAX;
        for (i, dev) in devices.iter().enumerate() {
            leg_len = leg_len.min(usable(i, dev, data_offset, stripe_unit)?);
        }
        let width =
            u32::try_from(devices.len()).map_err(|_| VolumeError::TooManyDevices(devices.len()))?;
        let legs: Vec<StripeLeg> = (0..width)
            .map(|i| StripeLeg {
                device: DeviceIndex(i),
                phys_start: data_offset,
            })
            .collect();
        let segments = if legs.is_empty() {
            Vec::new()
        } else {
            vec![Segment {
                vol_start: 0,
                len: leg_len * u64::from(width),
                stripe_unit,
                legs,
            }]
        };
        Volume::from_segments(
            block_size,
            devices,
            segments,
            LayoutKind::Striped { stripe_unit, width },
        )
    }

    /// A volume from explicit segments (used for LVM2 logical volumes and for decoding).
    /// Checks that the segments cover `[0, size)` in order without gaps, that every leg fits on
    /// its device, and that no two legs share physical bytes.
    pub fn from_segments(
        block_size: u32,
        devices: Vec<VolumeDevice>,
        segments: Vec<Segment>,
        kind: LayoutKind,
    ) -> Result<Volume, VolumeError> {
        check_block_size(block_size)?;
        if devices.is_empty() || segments.is_empty() {
            return Err(VolumeError::NoDevices);
        }
        if u32::try_from(devices.len()).is_err() {
            return Err(VolumeError::TooManyDevices(devices.len()));
        }
        let mut ids: Vec<&DeviceId> = devices.iter().map(|d| &d.uuid).collect();
        ids.sort_unstable();
        if let Some(pair) = ids.windows(2).find(|p| p[0] == p[1]) {
            return Err(VolumeError::DuplicateDevice { uuid: *pair[0] });
        }
        let bs = u64::from(block_size);
        let bad = |index: usize, reason: String| VolumeError::BadSegment { index, reason };
        // (device, phys_start, phys_end, segment) of every leg, to find overlaps.
        let mut used: Vec<(u32, u64, u64, usize)> = Vec::new();
        let mut expect_start = 0u64;
        for (index, seg) in segments.iter().enumerate() {
            if seg.vol_start != expect_start {
                return Err(bad(
                    index,
                    format!("starts at {} instead of {expect_start}", seg.vol_start),
                ));
            }
            if seg.legs.is_empty() {
                return Err(bad(index, "has no stripe legs".into()));
            }
            if seg.len == 0 || seg.len % bs != 0 {
                return Err(bad(
                    index,
                    format!("length {} is not a positive multiple of {bs}", seg.len),
                ));
            }
            if seg.stripe_unit == 0 || seg.stripe_unit % bs != 0 {
                return Err(bad(
                    index,
                    format!("stripe unit {} is not a multiple of {bs}", seg.stripe_unit),
                ));
            }
            let width = seg.legs.len() as u64;
            let row = seg.stripe_unit.checked_mul(width).ok_or_else(|| {
                bad(
                    index,
                    format!("stripe row of {width} x {} overflows", seg.stripe_unit),
                )
            })?;
            if width > 1 && seg.len % row != 0 {
                return Err(bad(
                    index,
                    format!(
                        "length {} is not a whole number of {width} x {} stripes",
                        seg.len, seg.stripe_unit
                    ),
                ));
            }
            let leg_len = seg.len / width;
            for leg in &seg.legs {
                let dev = devices.get(leg.device.as_usize()).ok_or_else(|| {
                    bad(
                        index,
                        format!("leg names device {} of {}", leg.device, devices.len()),
                    )
                })?;
                if leg.phys_start % 512 != 0 {
                    return Err(bad(
                        index,
                        format!("leg starts at {}, not a 512-byte boundary", leg.phys_start),
                    ));
                }
                let end = leg
                    .phys_start
                    .checked_add(leg_len)
                    .filter(|&e| e <= dev.size_bytes);
                let Some(end) = end else {
                    return Err(bad(
                        index,
                        format!(
                            "leg {}+{leg_len} runs past the end of {} ({} bytes)",
                            leg.phys_start, leg.device, dev.size_bytes
                        ),
                    ));
                };
                used.push((leg.device.0, leg.phys_start, end, index));
            }
            expect_start = seg
                .vol_start
                .checked_add(seg.len)
                .ok_or_else(|| bad(index, "ends past 2^64".into()))?;
        }
        used.sort_unstable();
        for pair in used.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if a.0 == b.0 && b.1 < a.2 {
                return Err(bad(
                    b.3,
                    format!("overlaps segment {} on device d{}", a.3, a.0),
                ));
            }
        }
        Ok(Volume {
            block_size,
            devices,
            segments,
            kind,
        })
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn devices(&self) -> &[VolumeDevice] {
        &self.devices
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    pub fn kind(&self) -> &LayoutKind {
        &self.kind
    }

    /// Size of the volume's address space in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.segments.last().map_or(0, Segment::vol_end)
    }

    /// Size of the volume in blocks.
    pub fn size_blocks(&self) -> u64 {
        self.size_bytes() / u64::from(self.block_size)
    }

    /// The index of the device with this UUID.
    pub fn device_index(&self, uuid: &DeviceId) -> Option<DeviceIndex> {
        self.devices
            .iter()
            .position(|d| d.uuid == *uuid)
            .map(|i| DeviceIndex(i as u32))
    }

    /// The segment holding volume byte `off`.
    pub fn segment_at(&self, off: u64) -> Option<&Segment> {
        let i = self.segments.partition_point(|s| s.vol_end() <= off);
        self.segments.get(i).filter(|s| s.vol_start <= off)
    }

    /// Stripe unit and width at volume byte `off`, if the volume is striped there.
    pub fn stripe_geometry_at(&self, off: u64) -> Option<(u64, u32)> {
        self.segment_at(off)
            .filter(|s| s.legs.len() > 1)
            .map(|s| (s.stripe_unit, s.legs.len() as u32))
    }

    /// Map the volume byte range `[offset, offset + len)` to physical runs, in volume order.
    /// Each run lies inside one stripe unit of one segment; callers that want fewer, larger
    /// I/Os merge runs (see [`crate::plan`]).
    pub fn map(&self, offset: u64, len: u64) -> Result<Vec<PhysRun>, VolumeError> {
        let mut runs = Vec::new();
        self.map_with(offset, len, |run| runs.push(run))?;
        Ok(runs)
    }

    /// Like [`Volume::map`], but hands each run to `f` instead of collecting them.
    pub fn map_with(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(PhysRun),
    ) -> Result<(), VolumeError> {
        let size = self.size_bytes();
        let end = offset.checked_add(len).filter(|&e| e <= size);
        let Some(end) = end else {
            return Err(VolumeError::OutOfRange { offset, len, size });
        };
        let mut i = self.segments.partition_point(|s| s.vol_end() <= offset);
        let mut off = offset;
        while off < end {
            let seg = &self.segments[i];
            let run = seg.map_one(off, end.min(seg.vol_end()) - off);
            off += run.len;
            if off == seg.vol_end() {
                i += 1;
            }
            f(run);
        }
        Ok(())
    }

    /// The device byte ranges that hold the volume ranges `ranges` (`(offset, len)` pairs),
    /// sorted by device and offset, one per physically contiguous stretch of a device
    /// (touching or overlapping pieces merged): for work that covers every byte in no
    /// particular order and has no buffer (zeroing, discard). A striped range yields one
    /// range per device, not one per stripe unit.
    pub fn device_ranges(
        &self,
        ranges: impl IntoIterator<Item = (u64, u64)>,
    ) -> Result<Vec<DeviceRange>, VolumeError> {
        let mut out = Vec::new();
        for (offset, len) in ranges {
            self.map_with(offset, len, |run| {
                out.push(DeviceRange {
                    device: run.device,
                    phys_off: run.phys_off,
                    len: run.len,
                });
            })?;
        }
        Ok(merge_device_ranges(out))
    }

    /// The volume grown by `new_devices` (appended after the existing ones) laid out as one
    /// new segment at the end of the address space: linear over one device, or striped over
    /// all of them in units of `stripe_unit` (each device contributes as many bytes as the
    /// smallest, after `data_offset`, rounded down to whole stripe units). Every byte of the
    /// old volume keeps its mapping; the kind stays what the volume was built as.
    pub fn with_segment_appended(
        &self,
        new_devices: Vec<VolumeDevice>,
        data_offset: u64,
        stripe_unit: Option<u64>,
    ) -> Result<Volume, VolumeError> {
        if new_devices.is_empty() {
            return Err(VolumeError::NoDevices);
        }
        let bs = u64::from(self.block_size);
        let first = self.devices.len();
        let unit = match stripe_unit {
            Some(su) if su == 0 || !su.is_multiple_of(bs) => {
                return Err(VolumeError::BadStripeUnit {
                    stripe_unit: su,
                    block_size: self.block_size,
                });
            }
            Some(su) => su,
            None if new_devices.len() > 1 => {
                return Err(VolumeError::NotAGrowth(
                    "a linear growth adds one device at a time".into(),
                ));
            }
            None => bs,
        };
        let mut leg_len = u64::MAX;
        for (i, dev) in new_devices.iter().enumerate() {
            leg_len = leg_len.min(usable(first + i, dev, data_offset, unit)?);
        }
        let width = new_devices.len() as u64;
        let legs: Vec<StripeLeg> = (0..new_devices.len())
            .map(|i| {
                u32::try_from(first + i)
                    .map(|d| StripeLeg {
                        device: DeviceIndex(d),
                        phys_start: data_offset,
                    })
                    .map_err(|_| VolumeError::TooManyDevices(first + i + 1))
            })
            .collect::<Result<_, _>>()?;
        let len = leg_len
            .checked_mul(width)
            .ok_or_else(|| VolumeError::NotAGrowth("the new segment overflows".into()))?;
        let mut segments = self.segments.clone();
        segments.push(Segment {
            vol_start: self.size_bytes(),
            len,
            stripe_unit: unit,
            legs,
        });
        let mut devices = self.devices.clone();
        devices.extend(new_devices);
        Volume::from_segments(self.block_size, devices, segments, self.kind.clone())
    }

    /// Checks that `self` is `old` grown: the same block size, `old`'s devices first (same
    /// identities; a device may have grown), `old`'s segments unchanged but for the last,
    /// which may be longer (LVM2 merges an extension that continues a segment on the same
    /// PVs into it), and at least one more block. So every volume block of `old` maps to the
    /// same place in `self`, and extents, grants and I/O plans made with `old` stay true.
    pub fn check_grows(&self, old: &Volume) -> Result<(), VolumeError> {
        let no = |why: String| Err(VolumeError::NotAGrowth(why));
        if self.block_size != old.block_size {
            return no(format!(
                "block size {} instead of {}",
                self.block_size, old.block_size
            ));
        }
        if self.devices.len() < old.devices.len() {
            return no(format!(
                "{} devices instead of at least {}",
                self.devices.len(),
                old.devices.len()
            ));
        }
        for (i, (new, was)) in self.devices.iter().zip(&old.devices).enumerate() {
            if new.uuid != was.uuid {
                return no(format!(
                    "device d{i} is {} instead of {}",
                    new.uuid, was.uuid
                ));
            }
            if new.size_bytes < was.size_bytes {
                return no(format!("device d{i} ({}) shrank", new.uuid));
            }
        }
        let Some((last, before)) = old.segments.split_last() else {
            return no("the old volume has no segments".into());
        };
        for (i, was) in before.iter().enumerate() {
            if self.segments.get(i) != Some(was) {
                return no(format!("segment {i} changed"));
            }
        }
        let same_last = self.segments.get(before.len()).is_some_and(|s| {
            s.vol_start == last.vol_start
                && s.stripe_unit == last.stripe_unit
                && s.legs == last.legs
                && s.len >= last.len
        });
        if !same_last {
            return no(format!("segment {} changed", before.len()));
        }
        if self.size_blocks() <= old.size_blocks() {
            return no(format!(
                "{} bytes is not more than {}",
                self.size_bytes(),
                old.size_bytes()
            ));
        }
        Ok(())
    }

    /// Allocation groups as `(start_block, len_blocks)`: one per device region, so that
    /// allocations spread over the LUNs. A linear segment is one group; a striped segment is
    /// cut into one group per leg at whole-stripe-row boundaries.
    pub fn allocation_groups(&self) -> Vec<(u64, u64)> {
        let bs = u64::from(self.block_size);
        let mut groups = Vec::new();
        for seg in &self.segments {
            let width = seg.legs.len() as u64;
            if width == 1 {
                groups.push((seg.vol_start / bs, seg.len / bs));
                continue;
            }
            let row = seg.stripe_unit * width;
            let rows = seg.len / row;
            let rows_per_group = rows.div_ceil(width).max(1);
            let mut start = seg.vol_start;
            while start < seg.vol_end() {
                let len = (rows_per_group * row).min(seg.vol_end() - start);
                groups.push((start / bs, len / bs));
                start += len;
            }
        }
        groups
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;

    fn devs(n: u32, size: u64) -> Vec<VolumeDevice> {
        (0..n)
            .map(|i| VolumeDevice {
                uuid: DeviceId::Sanfs(Uuid::from_u128(u128::from(i) + 1)),
                size_bytes: size,
            })
            .collect()
    }

    fn show(runs: &[PhysRun]) -> String {
        runs.iter()
            .map(|r| format!("{}@{}+{}", r.device, r.phys_off / KIB, r.len / KIB))
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn linear_concatenates_devices_after_their_labels() {
        let v = Volume::linear(4096, devs(2, 5 * MIB), MIB).unwrap();
        assert_eq!(v.size_bytes(), 8 * MIB);
        let runs = v.map(3 * MIB, 2 * MIB).unwrap();
        assert_eq!(show(&runs), "d0@4096+1024 d1@1024+1024");
        assert_eq!(v.allocation_groups(), vec![(0, 1024), (1024, 1024)]);
    }

    #[test]
    fn striped_round_robins_stripe_units() {
        let v = Volume::striped(4096, devs(4, 9 * MIB), MIB, 64 * KIB).unwrap();
        assert_eq!(v.size_bytes(), 32 * MIB);
        let runs = v.map(32 * KIB, 256 * KIB).unwrap();
        assert_eq!(
            show(&runs),
            "d0@1056+32 d1@1024+64 d2@1024+64 d3@1024+64 d0@1088+32"
        );
        assert_eq!(v.stripe_geometry_at(0), Some((64 * KIB, 4)));
        let groups = v.allocation_groups();
        assert_eq!(groups.len(), 4);
        assert_eq!(groups.iter().map(|g| g.1).sum::<u64>(), v.size_blocks());
    }

    #[test]
    fn device_ranges_of_a_striped_range_are_one_per_device() {
        let v = Volume::striped(4096, devs(4, 9 * MIB), MIB, 64 * KIB).unwrap();
        // 8 MiB from 32 KiB: 129 stripe-unit runs, four device ranges.
        assert_eq!(v.map(32 * KIB, 8 * MIB).unwrap().len(), 129);
        let r = v.device_ranges([(32 * KIB, 8 * MIB)]).unwrap();
        let show: Vec<String> = r
            .iter()
            .map(|r| format!("{}@{}+{}", r.device, r.phys_off / KIB, r.len / KIB))
            .collect();
        assert_eq!(
            show,
            [
                "d0@1056+2048",
                "d1@1024+2048",
                "d2@1024+2048",
                "d3@1024+2048"
            ]
        );
        // Every byte once: as many bytes as asked for.
        assert_eq!(r.iter().map(|r| r.len).sum::<u64>(), 8 * MIB);
        // Two volume ranges that meet on the devices merge too; overlaps count once.
        let two = v
            .device_ranges([(0, 4 * MIB), (4 * MIB, 4 * MIB), (MIB, MIB)])
            .unwrap();
        assert_eq!(two.len(), 4);
        assert_eq!(two.iter().map(|r| r.len).sum::<u64>(), 8 * MIB);
        // Ranges that do not touch stay apart; empty ones go.
        let apart = merge_device_ranges(vec![
            DeviceRange {
                device: DeviceIndex(1),
                phys_off: 100,
                len: 10,
            },
            DeviceRange {
                device: DeviceIndex(0),
                phys_off: 0,
                len: 0,
            },
            DeviceRange {
                device: DeviceIndex(1),
                phys_off: 0,
                len: 50,
            },
            DeviceRange {
                device: DeviceIndex(1),
                phys_off: 40,
                len: 20,
            },
        ]);
        assert_eq!(
            apart,
            vec![
                DeviceRange {
                    device: DeviceIndex(1),
                    phys_off: 0,
                    len: 60
                },
                DeviceRange {
                    device: DeviceIndex(1),
                    phys_off: 100,
                    len: 10
                },
            ]
        );
        assert!(v.device_ranges([(v.size_bytes(), 1)]).is_err());
    }

    #[test]
    fn striped_uses_the_smallest_device_and_whole_stripe_units() {
        let mut d = devs(3, 10 * MIB);
        d[1].size_bytes = 4 * MIB + 100 * KIB;
        let v = Volume::striped(4096, d, MIB, 64 * KIB).unwrap();
        assert_eq!(v.size_bytes(), 3 * (3 * MIB + 64 * KIB));
    }

    #[test]
    fn out_of_range_and_overflow_are_errors() {
        let v = Volume::linear(4096, devs(1, 2 * MIB), MIB).unwrap();
        assert!(matches!(v.map(MIB, 1), Err(VolumeError::OutOfRange { .. })));
        assert!(matches!(
            v.map(u64::MAX, 2),
            Err(VolumeError::OutOfRange { .. })
        ));
        assert_eq!(v.map(0, 0).unwrap(), vec![]);
    }

    #[test]
    fn bad_volumes_are_refused() {
        assert_eq!(
            Volume::linear(1000, devs(1, MIB), 0),
            Err(VolumeError::BadBlockSize(1000))
        );
        assert!(matches!(
            Volume::linear(4096, devs(1, MIB), MIB),
            Err(VolumeError::DeviceTooSmall { .. })
        ));
        assert!(matches!(
            Volume::striped(4096, devs(2, 4 * MIB), 0, 6000),
            Err(VolumeError::BadStripeUnit { .. })
        ));
        let mut d = devs(2, 4 * MIB);
        d[1].uuid = d[0].uuid;
        assert!(matches!(
            Volume::linear(4096, d, 0),
            Err(VolumeError::DuplicateDevice { .. })
        ));
        // Two segments that share physical bytes on one device.
        let seg = |vol_start| Segment {
            vol_start,
            len: MIB,
            stripe_unit: 4096,
            legs: vec![StripeLeg {
                device: DeviceIndex(0),
                phys_start: 512 * KIB,
            }],
        };
        let r = Volume::from_segments(
            4096,
            devs(1, 4 * MIB),
            vec![seg(0), seg(MIB)],
            LayoutKind::Linear,
        );
        assert!(
            matches!(r, Err(VolumeError::BadSegment { index: 1, .. })),
            "{r:?}"
        );
    }

    #[test]
    fn lvm_pv_ids_round_trip() {
        let text = "aDdf5U-Xy1c-00Ab-cdEF-ghij-klmn-opqrst";
        let id = LvmPvId::parse(text).unwrap();
        assert_eq!(id.to_string(), text);
        assert_eq!(LvmPvId::parse(&text.replace('-', "")), Some(id));
        assert_eq!(LvmPvId::parse("short"), None);
        assert_eq!(LvmPvId::parse(&format!("{text}x")), None);
        assert_eq!(LvmPvId::parse(&text.replace('a', "!")), None);
    }

    #[test]
    fn hostile_stripe_geometry_is_an_error_not_a_panic() {
        let legs = (0..5)
            .map(|i| StripeLeg {
                device: DeviceIndex(i),
                phys_start: 0,
            })
            .collect::<Vec<_>>();
        let seg = Segment {
            vol_start: 0,
            len: 5 << 40,
            stripe_unit: 1 << 62,
            legs,
        };
        let r = Volume::from_segments(4096, devs(5, u64::MAX), vec![seg], LayoutKind::Linear);
        assert!(
            matches!(r, Err(VolumeError::BadSegment { index: 0, .. })),
            "{r:?}"
        );
    }

    #[test]
    fn multi_segment_volume_maps_across_segments() {
        // Segment 0: 2 legs x 64 KiB stripes; segment 1: linear on device 2.
        let segments = vec![
            Segment {
                vol_start: 0,
                len: 256 * KIB,
                stripe_unit: 64 * KIB,
                legs: vec![
                    StripeLeg {
                        device: DeviceIndex(0),
                        phys_start: MIB,
                    },
                    StripeLeg {
                        device: DeviceIndex(1),
                        phys_start: MIB,
                    },
                ],
            },
            Segment {
                vol_start: 256 * KIB,
                len: 512 * KIB,
                stripe_unit: 4096,
                legs: vec![StripeLeg {
                    device: DeviceIndex(2),
                    phys_start: 2 * MIB,
                }],
            },
        ];
        let v =
            Volume::from_segments(4096, devs(3, 4 * MIB), segments, LayoutKind::Linear).unwrap();
        let runs = v.map(128 * KIB, 256 * KIB).unwrap();
        assert_eq!(show(&runs), "d0@1088+64 d1@1088+64 d2@2048+128");
    }

    fn new_devs(from: u32, n: u32, size: u64) -> Vec<VolumeDevice> {
        (from..from + n)
            .map(|i| VolumeDevice {
                uuid: DeviceId::Sanfs(Uuid::from_u128(u128::from(i) + 1)),
                size_bytes: size,
            })
            .collect()
    }

    #[test]
    fn appended_stripe_set_keeps_old_mapping_and_maps_new_space() {
        let old = Volume::striped(4096, devs(2, 9 * MIB), MIB, 64 * KIB).unwrap();
        let grown = old
            .with_segment_appended(new_devs(2, 2, 5 * MIB), MIB, Some(64 * KIB))
            .unwrap();
        grown.check_grows(&old).unwrap();
        assert_eq!(grown.devices().len(), 4);
        assert_eq!(grown.size_bytes(), old.size_bytes() + 2 * 4 * MIB);
        // Every old byte maps as before.
        assert_eq!(
            grown.map(0, old.size_bytes()).unwrap(),
            old.map(0, old.size_bytes()).unwrap()
        );
        // The new space alternates over d2 and d3 from their data offset.
        let runs = grown.map(old.size_bytes(), 128 * KIB).unwrap();
        let got: Vec<(u32, u64)> = runs.iter().map(|r| (r.device.0, r.phys_off)).collect();
        assert_eq!(got, vec![(2, MIB), (3, MIB)]);
        // The allocator's groups of the old part are unchanged; new ones follow.
        let (g_old, g_new) = (old.allocation_groups(), grown.allocation_groups());
        assert_eq!(&g_new[..g_old.len()], &g_old[..]);
        assert!(g_new.len() > g_old.len());
    }

    #[test]
    fn appended_linear_segment_is_one_device() {
        let old = Volume::linear(4096, devs(1, 4 * MIB), MIB).unwrap();
        let grown = old
            .with_segment_appended(new_devs(1, 1, 3 * MIB), MIB, None)
            .unwrap();
        grown.check_grows(&old).unwrap();
        assert_eq!(grown.size_bytes(), 3 * MIB + 2 * MIB);
        let run = grown.map(3 * MIB, 4096).unwrap()[0];
        assert_eq!((run.device.0, run.phys_off), (1, MIB));
        assert!(matches!(
            old.with_segment_appended(new_devs(1, 2, 3 * MIB), MIB, None),
            Err(VolumeError::NotAGrowth(_))
        ));
        // A device already in the volume cannot be added again.
        assert!(matches!(
            old.with_segment_appended(devs(1, 4 * MIB), MIB, None),
            Err(VolumeError::DuplicateDevice { .. })
        ));
        // Too small for one block after the data offset.
        assert!(matches!(
            old.with_segment_appended(new_devs(1, 1, MIB), MIB, None),
            Err(VolumeError::DeviceTooSmall { .. })
        ));
    }

    #[test]
    fn check_grows_refuses_what_would_move_old_blocks() {
        let old = Volume::linear(4096, devs(2, 4 * MIB), MIB).unwrap();
        // The same volume is no growth.
        assert!(old.check_grows(&old).is_err());
        // Devices reordered.
        let mut swapped = devs(2, 4 * MIB);
        swapped.swap(0, 1);
        let other = Volume::linear(4096, swapped, MIB).unwrap();
        assert!(other.check_grows(&old).is_err());
        // A smaller volume.
        assert!(
            old.check_grows(&Volume::linear(4096, devs(2, 5 * MIB), MIB).unwrap())
                .is_err()
        );
        // The last segment lengthened on a grown device (an LVM2 extension merged into it).
        let mut bigger = devs(2, 4 * MIB);
        bigger[1].size_bytes = 6 * MIB;
        let longer = Volume::linear(4096, bigger, MIB).unwrap();
        longer.check_grows(&old).unwrap();
        // The first segment lengthened moves every block of the second: refused.
        let mut first_bigger = devs(2, 4 * MIB);
        first_bigger[0].size_bytes = 6 * MIB;
        let moved = Volume::linear(4096, first_bigger, MIB).unwrap();
        assert!(moved.check_grows(&old).is_err());
        // Another block size.
        assert!(
            Volume::linear(8192, devs(3, 4 * MIB), MIB)
                .unwrap()
                .check_grows(&old)
                .is_err()
        );
    }
}
