SELECT address FROM standbys WHERE pool = $1 AND id <> $2
    AND seen > clock_timestamp() - interval '3 seconds' ORDER BY address
