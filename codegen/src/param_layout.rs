//! Where a spec's parameters and a call's data tensors lie in the one 32-bit buffer kernels
//! read them from ([`ParamLayout`]), and the check that a call's buffer holds it.

use attn_dsl::{AttentionSpec, DataType};

/// Where a spec's parameters and a call's data tensors lie in the one 32-bit buffer kernels
/// read them from: each parameter row-major, in declaration order, back to back; then a header
/// per data tensor ([`DataSlot`]), whose shape and place the call fills in; then the call's
/// data (i32 elements stored by their bits), placed by the headers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParamLayout {
    /// One slot per declared parameter.
    pub slots: Vec<ParamSlot>,
    /// One slot per declared data tensor.
    pub data: Vec<DataSlot>,
}

/// One parameter's place in a [`ParamLayout`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSlot {
    /// The declared name.
    pub name: String,
    /// The resolved shape.
    pub shape: Vec<usize>,
    /// Index of its first element in the buffer.
    pub offset: usize,
}

/// One data tensor's header in a [`ParamLayout`]: `1 + 2 rank` i32 words at `header`, the
/// index of its first element in the buffer, then each dimension's length, then each
/// dimension's origin (the call's position offset along `seq`, else 0). A read at indices `i`
/// reads element `first + sum_d clamp(i_d - origin_d, 0, len_d - 1) stride_d`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataSlot {
    /// The declared name.
    pub name: String,
    /// Its number of dimensions.
    pub rank: usize,
    /// The element type.
    pub dtype: DataType,
    /// Index of the header's first word in the buffer.
    pub header: usize,
}

impl DataSlot {
    /// Words in the header.
    pub fn header_len(&self) -> usize {
        1 + 2 * self.rank
    }
}

impl ParamLayout {
    /// The layout of a valid spec's parameters (validation bounds the total to 2^24) and data
    /// headers.
    pub fn of(spec: &AttentionSpec) -> ParamLayout {
        let mut offset = 0;
        let slots = spec
            .params
            .iter()
            .map(|p| {
                let shape = spec.param_shape(p);
                let slot = ParamSlot {
                    name: p.name.clone(),
                    offset,
                    shape,
                };
                offset += slot.shape.iter().product::<usize>();
                slot
            })
            .collect();
        let data = spec
            .data
            .iter()
            .map(|d| {
                let slot = DataSlot {
                    name: d.name.clone(),
                    rank: d.dims.len(),
                    dtype: d.dtype,
                    header: offset,
                };
                offset += slot.header_len();
                slot
            })
            .collect();
        ParamLayout { slots, data }
    }

    /// Words before the call's data: the parameters and the data headers.
    pub fn len(&self) -> usize {
        let params = self
            .slots
            .last()
            .map_or(0, |s| s.offset + s.shape.iter().product::<usize>());
        self.data
            .last()
            .map_or(params, |d| d.header + d.header_len())
    }

    /// Whether the spec has neither parameters nor data tensors.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty() && self.data.is_empty()
    }

    /// The slot of the parameter `name`.
    pub fn slot(&self, name: &str) -> Option<&ParamSlot> {
        self.slots.iter().find(|s| s.name == name)
    }

    /// The slot of the data tensor `name`.
    pub fn data_slot(&self, name: &str) -> Option<&DataSlot> {
        self.data.iter().find(|s| s.name == name)
    }

    /// Checks that a call's buffer holds this layout and that every data header places its
    /// tensor inside the buffer (the element an empty tensor's reads clamp to included), so
    /// that kernels, which trust the headers, never read past it.
    pub fn check_buffer(&self, buffer: &[f32]) -> Result<(), String> {
        let fixed = self.len();
        if buffer.len() < fixed || (self.data.is_empty() && buffer.len() != fixed) {
            return Err(format!(
                "{} parameter values given; the spec's parameters and data headers hold {fixed}",
                buffer.len()
            ));
        }
        let word = |at: usize| i64::from(buffer[at].to_bits() as i32);
        for slot in &self.data {
            let first = word(slot.header);
            let mut elements: i64 = 1;
            for axis in 0..slot.rank {
                let len = word(slot.header + 1 + axis);
                elements = if len < 0 {
                    -1
                } else {
                    elements.saturating_mul(len)
                };
            }
            let end = first.saturating_add(elements.max(1));
            if first < fixed as i64 || elements < 0 || end > buffer.len() as i64 {
                return Err(format!(
                    "the header of data tensor `{}` places {elements} elements at {first}, \
                     outside the buffer of {} values",
                    slot.name,
                    buffer.len()
                ));
            }
        }
        Ok(())
    }
}
