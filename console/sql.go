package console

import "github.com/txbox/txbox/internal/sqlname"

// queries are the console's own statements: the audit (migration 00007).
type queries struct {
	insertAudit, listAudit, auditExists string
}

func renderQueries(schema string) queries {
	r := func(s string) string { return sqlname.Render(s, schema) }
	return queries{
		insertAudit: r(`INSERT INTO {schema}.txbox_console_audit (operator, action, target, detail, result)
			VALUES ($1, $2, $3, $4, $5)`),
		// The newest first; $1 the limit.
		listAudit: r(`SELECT id, at, operator, action, target, detail, result FROM {schema}.txbox_console_audit
			ORDER BY id DESC LIMIT $1`),
		// The quoted schema is a validated identifier in double quotes: it holds no single quote.
		auditExists: r(`SELECT to_regclass('{schema}.txbox_console_audit') IS NOT NULL`),
	}
}
