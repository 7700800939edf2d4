//! A [`Query`] as SQL: a WHERE fragment made only of placeholders, so the
//! statement text depends on the query's shape, never on its values.

use sqlx::postgres::PgArguments;
use sqlx::query::QueryAs;
use sqlx::{AssertSqlSafe, Postgres};

use super::model::Query;

/// The WHERE fragment for `query` over `pgonce.events e`, with its binds.
pub(crate) struct Filter {
    pub sql: String,
    pub binds: Vec<Vec<String>>,
}

impl Filter {
    /// Builds the fragment, numbering placeholders from `$first`.
    ///
    /// An item becomes `(e.tags @> $n AND e.type = ANY($m))`, leaving out
    /// the half it does not constrain; items are OR-ed. The tag half is
    /// answered by the GIN index on `tags`, the type half by the B-tree on
    /// `(type, position)`, and an OR of items by a BitmapOr of both.
    pub fn new(query: &Query, first: usize) -> Filter {
        let Query::Items(items) = query else {
            return Filter {
                sql: "TRUE".into(),
                binds: Vec::new(),
            };
        };
        let mut binds = Vec::new();
        let mut ors = Vec::new();
        for item in items {
            let mut ands = Vec::new();
            if !item.tags.is_empty() {
                binds.push(item.tags.clone());
                ands.push(format!("e.tags @> ${}::text[]", first + binds.len() - 1));
            }
            if !item.types.is_empty() {
                binds.push(item.types.clone());
                ands.push(format!(
                    "e.type = ANY(${}::text[])",
                    first + binds.len() - 1
                ));
            }
            ors.push(format!("({})", ands.join(" AND ")));
        }
        Filter {
            sql: ors.join(" OR "),
            binds,
        }
    }

    /// `template` with `{filter}` replaced.
    pub fn statement(&self, template: &str) -> AssertSqlSafe<String> {
        AssertSqlSafe(template.replace("{filter}", &self.sql))
    }

    /// What the filter's parameters send PostgreSQL ([`text_array_bytes`]
    /// each): the bytes beside an append's events that grow with its
    /// condition.
    pub fn sent_bytes(&self) -> usize {
        self.binds.iter().map(|b| text_array_bytes(b)).sum()
    }

    pub fn bind_as<'q, O>(
        &self,
        mut q: QueryAs<'q, Postgres, O, PgArguments>,
    ) -> QueryAs<'q, Postgres, O, PgArguments> {
        for b in &self.binds {
            q = q.bind(b.clone());
        }
        q
    }
}

/// What a statement sends PostgreSQL for a `text[]` parameter holding
/// `strings`: the parameter's length (4 bytes), the array's header (the
/// number of dimensions, a flags word, the element type, and the one
/// dimension's length and lower bound: 4 bytes each), and each element's
/// length (4) before its bytes. Counted by hand: sqlx encodes the array
/// without saying its size first.
pub(crate) fn text_array_bytes(strings: &[String]) -> usize {
    4 + 5 * 4 + strings.iter().map(|s| 4 + s.len()).sum::<usize>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::QueryItem;

    #[test]
    fn items_become_ored_placeholders() {
        let q = Query::items([
            QueryItem::new().types(["A", "B"]).tags(["t1", "t2"]),
            QueryItem::new().types(["C"]),
            QueryItem::new().tags(["t3"]),
        ])
        .unwrap();
        let f = Filter::new(&q, 2);
        assert_eq!(
            f.sql,
            "(e.tags @> $2::text[] AND e.type = ANY($3::text[])) OR (e.type = ANY($4::text[])) OR (e.tags @> $5::text[])"
        );
        assert_eq!(f.binds.len(), 4);
        assert_eq!(Filter::new(&Query::all(), 1).sql, "TRUE");
    }
}
